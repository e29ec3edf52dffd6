"""Llama (Llama 2 and 3, TinyLlama, SmolLM2, ...): RMS norms, SiLU-gated MLP, rotary positions,
grouped-query attention; optional attention and MLP biases."""
from __future__ import annotations

from decoders.blocks import MLP, Attention, Decoder, DecoderLayer, Embedding, Head, Norm, Rotary
from decoders.description import ConfigReader, Family, rope_inverse_frequencies
from decoders.model import DecoderForSampling

LAYER = "model.layers.{i}."


def describe(config: ConfigReader, fuse_qkv: bool = True) -> Decoder:
    hidden = int(config.get("hidden_size"))
    n_heads = int(config.get("num_attention_heads"))
    head_dim = int(config.get("head_dim", default=hidden // n_heads))
    vocab = int(config.get("vocab_size"))
    eps = float(config.get("rms_norm_eps", default=1e-6))
    rope = config.rope()
    theta = float(rope.get("rope_theta") or config.get("rope_theta", default=10000.0))
    attention_bias = bool(config.get("attention_bias", default=False))
    mlp_bias = bool(config.get("mlp_bias", default=False))

    def norm(name: str) -> Norm:
        return Norm(name, hidden, "rms", eps=eps)

    attention = Attention(
        out=LAYER + "self_attn.o_proj", q=LAYER + "self_attn.q_proj", k=LAYER + "self_attn.k_proj",
        v=LAYER + "self_attn.v_proj", hidden=hidden, n_heads=n_heads,
        n_kv_heads=int(config.get("num_key_value_heads", default=n_heads)), head_dim=head_dim,
        qkv_bias=attention_bias, out_bias=attention_bias,
        positions=Rotary(rope_inverse_frequencies(rope, theta, head_dim)), fused=fuse_qkv)
    mlp = MLP(up=LAYER + "mlp.up_proj", down=LAYER + "mlp.down_proj", gate=LAYER + "mlp.gate_proj",
              hidden=hidden, intermediate=int(config.get("intermediate_size")),
              activation=config.get("hidden_act", default="silu"), bias=mlp_bias)
    layer = DecoderLayer(norm(LAYER + "input_layernorm"), attention, mlp, norm(LAYER + "post_attention_layernorm"))
    tied = bool(config.get("tie_word_embeddings", default=False))
    embedding = Embedding("model.embed_tokens.weight", vocab, hidden)
    head = Head(norm("model.norm"), vocab, hidden, None if tied else "lm_head.weight", tied_to=embedding.tokens)
    return Decoder(embedding, layer, head, int(config.get("num_hidden_layers")))


LLAMA = Family("llama", ("llama",), describe)


class LlamaForSampling(DecoderForSampling):
    family = LLAMA
