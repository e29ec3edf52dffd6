"""Gemma 3 text models (Gemma3ForCausalLM, model_type gemma3_text): Gemma 2's layout with per-head
q and k norms, no attention soft-capping, five sliding-window layers to each global one unless
layer_types says otherwise, and each kind of layer with its own rotary base (rope_local_base_freq
for the sliding-window layers; rope scaling, such as the larger models' linear factor 8, on the
global ones only)."""
from __future__ import annotations

from decoders.blocks import Decoder, Rotary
from decoders.description import ConfigReader, Family, rope_inverse_frequencies
from decoders.families.gemma2 import FULL, gemma_layout, optional
from decoders.model import DecoderForSampling

DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}    # HF's Gemma3TextConfig


def rope_of(config: ConfigReader, kind: str) -> tuple[dict, float]:
    """A kind of layer's rotary settings and base: transformers 5 nests them by layer type in
    rope_parameters; older configs give rope_theta and rope_scaling for the global layers and
    rope_local_base_freq for the others."""
    nested = config.config.get("rope_parameters") or {}
    if kind in nested:
        rope = dict(nested[kind] or {})
    else:
        flat = {k: v for k, v in nested.items() if not isinstance(v, dict)}
        rope = (flat or dict(config.config.get("rope_scaling") or {})) if kind == FULL else {}
    key = "rope_theta" if kind == FULL else "rope_local_base_freq"
    theta = rope.get("rope_theta") if kind == FULL or kind in nested else None
    return rope, float(theta or config.get(key, default=DEFAULT_THETA[kind]))


def describe(config: ConfigReader, fuse_qkv: bool = True) -> Decoder:
    def rotary(kind: str, head_dim: int) -> Rotary:
        rope, theta = rope_of(config, kind)
        return Rotary(rope_inverse_frequencies(rope, theta, head_dim))

    # HF's Gemma3Attention does not soft-cap its scores (Gemma 3 configs set attn_logit_softcapping null).
    return gemma_layout(config, fuse_qkv, pattern=int(config.get("sliding_window_pattern", default=6)),
                        rotary=rotary, attention_softcap=None,
                        final_softcap=optional(config, "final_logit_softcapping", None), qk_norm=True)


GEMMA3 = Family("gemma3", ("gemma3_text",), describe)


class Gemma3ForSampling(DecoderForSampling):
    family = GEMMA3
