"""Bloom: ALiBi positions, a layer norm on the embeddings, layer norms with biases, a fused
per-head QKV projection with biases, a tanh-GELU MLP with biases, tied LM head."""
from __future__ import annotations

from decoders.blocks import MLP, Alibi, Attention, Decoder, DecoderLayer, Embedding, Head, Norm
from decoders.description import ConfigReader, Family
from decoders.model import DecoderForSampling

LAYER = "transformer.h.{i}."


def describe(config: ConfigReader, fuse_qkv: bool = True) -> Decoder:
    hidden = int(config.get("hidden_size", "n_embed"))
    n_heads = int(config.get("n_head", "num_attention_heads"))
    vocab = int(config.get("vocab_size"))
    eps = float(config.get("layer_norm_epsilon", default=1e-5))
    config.refuse("apply_residual_connection_post_layernorm", bool, "residuals taken after the norm")
    config.refuse("pretraining_tp", lambda tp: tp > 1 and config.get("slow_but_exact", default=False),
                  "slow_but_exact sums the products in training's tensor-parallel slices")

    def norm(name: str) -> Norm:
        return Norm(name, hidden, "layer", bias=True, eps=eps)

    attention = Attention(out=LAYER + "self_attention.dense", qkv=LAYER + "self_attention.query_key_value",
                          hidden=hidden, n_heads=n_heads, n_kv_heads=n_heads, head_dim=hidden // n_heads,
                          qkv_bias=True, out_bias=True, positions=Alibi(), fused=fuse_qkv)
    mlp = MLP(up=LAYER + "mlp.dense_h_to_4h", down=LAYER + "mlp.dense_4h_to_h", hidden=hidden,
              intermediate=4 * hidden, activation="gelu_tanh", bias=True)
    layer = DecoderLayer(norm(LAYER + "input_layernorm"), attention, mlp,
                         norm(LAYER + "post_attention_layernorm"))
    tied = bool(config.get("tie_word_embeddings", default=True))
    embedding = Embedding("transformer.word_embeddings.weight", vocab, hidden,
                          norm=norm("transformer.word_embeddings_layernorm"))
    head = Head(norm("transformer.ln_f"), vocab, hidden, None if tied else "lm_head.weight",
                tied_to=embedding.tokens)
    return Decoder(embedding, layer, head, int(config.get("n_layer", "num_hidden_layers")))


BLOOM = Family("bloom", ("bloom",), describe)


class BloomForSampling(DecoderForSampling):
    family = BLOOM
