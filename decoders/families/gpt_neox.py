"""GPT-NeoX (Pythia, GPT-NeoX-20B, ...): layer norms with biases, GELU MLP with biases, a
fused per-head QKV projection, partial rotary positions, and a parallel residual."""
from __future__ import annotations

from decoders.blocks import MLP, Attention, Decoder, DecoderLayer, Embedding, Head, Norm, Rotary
from decoders.description import ConfigReader, Family, rope_inverse_frequencies
from decoders.model import DecoderForSampling

LAYER = "gpt_neox.layers.{i}."


def describe(config: ConfigReader, fuse_qkv: bool = True) -> Decoder:
    hidden = int(config.get("hidden_size"))
    n_heads = int(config.get("num_attention_heads"))
    head_dim = hidden // n_heads
    vocab = int(config.get("vocab_size"))
    eps = float(config.get("layer_norm_eps", default=1e-5))
    rope = config.rope()
    theta = float(rope.get("rope_theta") or config.get("rotary_emb_base", default=10000.0))
    partial = float(rope.get("partial_rotary_factor") or config.get("rotary_pct", default=0.25))
    bias = bool(config.get("attention_bias", default=True))

    def norm(name: str) -> Norm:
        return Norm(name, hidden, "layer", bias=True, eps=eps)

    attention = Attention(
        out=LAYER + "attention.dense", qkv=LAYER + "attention.query_key_value", hidden=hidden,
        n_heads=n_heads, n_kv_heads=n_heads, head_dim=head_dim, qkv_bias=bias, out_bias=bias,
        positions=Rotary(rope_inverse_frequencies(rope, theta, int(head_dim * partial))), fused=fuse_qkv)
    mlp = MLP(up=LAYER + "mlp.dense_h_to_4h", down=LAYER + "mlp.dense_4h_to_h", hidden=hidden,
              intermediate=int(config.get("intermediate_size")),
              activation=config.get("hidden_act", default="gelu"), bias=True)
    parallel = bool(config.get("use_parallel_residual", default=True))
    layer = DecoderLayer(norm(LAYER + "input_layernorm"), attention, mlp,
                         norm(LAYER + "post_attention_layernorm"),
                         residual="parallel" if parallel else "sequential")
    tied = bool(config.get("tie_word_embeddings", default=False))
    embedding = Embedding("gpt_neox.embed_in.weight", vocab, hidden)
    head = Head(norm("gpt_neox.final_layer_norm"), vocab, hidden,
                None if tied else ("embed_out.weight", "lm_head.weight"), tied_to=embedding.tokens)
    return Decoder(embedding, layer, head, int(config.get("num_hidden_layers")))


GPT_NEOX = Family("gpt_neox", ("gpt_neox",), describe)


class GPTNeoXForSampling(DecoderForSampling):
    family = GPT_NEOX
