"""Gemma 2: token rows scaled by sqrt(hidden), RMS norms that scale by 1 + weight, a norm before
and after both attention and the GeGLU MLP, attention scores scaled by query_pre_attn_scalar
and soft-capped, final logits soft-capped, sliding-window and global layers alternating
(layer_types), tied LM head.

`gemma_layout` is the Gemma 2 description with what Gemma 3 changes: each kind of layer's
rotary frequencies, per-head q/k norms, no attention soft-capping, another default pattern of
sliding-window and global layers.
"""
from __future__ import annotations

from typing import Callable

from decoders.blocks import MLP, Attention, Decoder, DecoderLayer, Embedding, Head, Norm, Rotary
from decoders.description import ConfigReader, Family, rope_inverse_frequencies
from decoders.model import DecoderForSampling

LAYER = "model.layers.{i}."
SLIDING, FULL = "sliding_attention", "full_attention"


def optional(config: ConfigReader, key: str, default: float | None) -> float | None:
    """A setting whose explicit null means "none" (HF's default where the key is absent)."""
    value = config.config.get(key, default)
    return None if value is None else float(value)


def layer_types(config: ConfigReader, pattern: int) -> list[str]:
    """Each layer's attention, "sliding_attention" or "full_attention": config's layer_types,
    else every `pattern`-th layer global (HF's default; Gemma 3's sliding_window_pattern)."""
    n_layers = int(config.get("num_hidden_layers"))
    kinds = config.get("layer_types", default=None) or [
        SLIDING if (i + 1) % pattern else FULL for i in range(n_layers)]
    if len(kinds) != n_layers or not set(kinds) <= {SLIDING, FULL}:
        raise ValueError(f"config.json's layer_types must give {n_layers} layers each {SLIDING!r} or "
                         f"{FULL!r}, got {kinds}")
    return list(kinds)


def gemma_layout(config: ConfigReader, fuse_qkv: bool, *, pattern: int,
                 rotary: Callable[[str, int], Rotary], attention_softcap: float | None,
                 final_softcap: float | None, qk_norm: bool = False) -> Decoder:
    """A Gemma-shaped decoder; `rotary(layer_type, head_dim)` gives each kind of layer's positions."""
    hidden = int(config.get("hidden_size"))
    n_heads = int(config.get("num_attention_heads"))
    head_dim = int(config.get("head_dim", default=hidden // n_heads))
    vocab = int(config.get("vocab_size"))
    eps = float(config.get("rms_norm_eps", default=1e-6))
    bias = bool(config.get("attention_bias", default=False))
    config.refuse("use_bidirectional_attention", bool, "attention to later tokens too")
    window = int(config.config.get("sliding_window") or 4096)   # HF's default

    def norm(name: str, width: int = hidden) -> Norm:
        return Norm(name, width, "rms", eps=eps, weight_offset=1.0)

    def layer(kind: str) -> DecoderLayer:
        attention = Attention(
            out=LAYER + "self_attn.o_proj", q=LAYER + "self_attn.q_proj", k=LAYER + "self_attn.k_proj",
            v=LAYER + "self_attn.v_proj", hidden=hidden, n_heads=n_heads,
            n_kv_heads=int(config.get("num_key_value_heads", default=n_heads)), head_dim=head_dim,
            qkv_bias=bias, out_bias=bias, positions=rotary(kind, head_dim),
            window=window if kind == SLIDING else None, fused=fuse_qkv,
            scores_scale=float(config.get("query_pre_attn_scalar", default=256)) ** -0.5,
            softcap=attention_softcap,
            q_norm=norm(LAYER + "self_attn.q_norm", head_dim) if qk_norm else None,
            k_norm=norm(LAYER + "self_attn.k_norm", head_dim) if qk_norm else None)
        mlp = MLP(up=LAYER + "mlp.up_proj", down=LAYER + "mlp.down_proj", gate=LAYER + "mlp.gate_proj",
                  hidden=hidden, intermediate=int(config.get("intermediate_size")),
                  activation=config.get("hidden_activation", "hidden_act", default="gelu_pytorch_tanh"))
        return DecoderLayer(norm(LAYER + "input_layernorm"), attention, mlp,
                            norm(LAYER + "pre_feedforward_layernorm"),
                            attention_out_norm=norm(LAYER + "post_attention_layernorm"),
                            mlp_out_norm=norm(LAYER + "post_feedforward_layernorm"))

    kinds = {kind: layer(kind) for kind in (SLIDING, FULL)}
    tied = bool(config.get("tie_word_embeddings", default=True))
    embedding = Embedding("model.embed_tokens.weight", vocab, hidden, scale=hidden ** 0.5)
    head = Head(norm("model.norm"), vocab, hidden, None if tied else "lm_head.weight",
                tied_to=embedding.tokens, softcap=final_softcap)
    return Decoder.of_layers(embedding, [kinds[kind] for kind in layer_types(config, pattern)], head)


def describe(config: ConfigReader, fuse_qkv: bool = True) -> Decoder:
    rope = config.rope()
    theta = float(rope.get("rope_theta") or config.get("rope_theta", default=10000.0))

    def rotary(kind: str, head_dim: int) -> Rotary:
        return Rotary(rope_inverse_frequencies(rope, theta, head_dim))

    return gemma_layout(config, fuse_qkv, pattern=2, rotary=rotary,
                        attention_softcap=optional(config, "attn_logit_softcapping", 50.0),
                        final_softcap=optional(config, "final_logit_softcapping", 30.0))


GEMMA2 = Family("gemma2", ("gemma2",), describe)


class Gemma2ForSampling(DecoderForSampling):
    family = GEMMA2
