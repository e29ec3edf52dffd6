"""Phi-3, Phi-3.5 and Phi-4 (mini and 14B): Llama's layer with one fused [q | k | v] projection
(qkv_proj) and one fused [gate | up] projection (gate_up_proj), rotary positions on all or part
of each head (partial_rotary_factor), LongRoPE scaling where rope_scaling says so, and a sliding
window on every layer where the config gives one."""
from __future__ import annotations

from decoders.blocks import MLP, Attention, Decoder, Norm, Rotary
from decoders.description import ConfigReader, Family, longrope, rope_inverse_frequencies
from decoders.families.llama import LAYER, llama_stack
from decoders.model import DecoderForSampling

# Older Phi-3 configs name LongRoPE "su" (and "yarn"), as HF's Phi3Config reads them.
LONGROPE_NAMES = ("longrope", "su", "yarn")


def positions(config: ConfigReader, head_dim: int) -> Rotary:
    rope = config.rope()
    theta = float(rope.get("rope_theta") or config.get("rope_theta", default=10000.0))
    partial = float(rope.get("partial_rotary_factor") or config.get("partial_rotary_factor", default=1.0))
    dim = int(head_dim * partial)
    if rope.get("rope_type", rope.get("type", "default")) not in LONGROPE_NAMES:
        return Rotary(rope_inverse_frequencies(rope, theta, dim))
    if rope.get("original_max_position_embeddings") is None:
        rope["original_max_position_embeddings"] = config.get("original_max_position_embeddings")
    return longrope(rope, theta, dim, int(config.get("max_position_embeddings")))


def describe(config: ConfigReader, fuse_qkv: bool = True) -> Decoder:
    hidden = int(config.get("hidden_size"))
    n_heads = int(config.get("num_attention_heads"))
    head_dim = int(config.get("head_dim", default=hidden // n_heads))
    eps = float(config.get("rms_norm_eps", default=1e-5))
    window = config.get("sliding_window", default=None)

    def norm(name: str) -> Norm:
        return Norm(name, hidden, "rms", eps=eps)

    attention = Attention(
        out=LAYER + "self_attn.o_proj", qkv=LAYER + "self_attn.qkv_proj", qkv_layout="contiguous",
        hidden=hidden, n_heads=n_heads, n_kv_heads=int(config.get("num_key_value_heads", default=n_heads)),
        head_dim=head_dim, positions=positions(config, head_dim),
        window=None if window is None else int(window), fused=fuse_qkv)
    mlp = MLP(up=LAYER + "mlp.gate_up_proj", down=LAYER + "mlp.down_proj", gate_up_fused=True, hidden=hidden,
              intermediate=int(config.get("intermediate_size")),
              activation=config.get("hidden_act", default="silu"))
    return llama_stack(config, attention, mlp, norm)


PHI3 = Family("phi3", ("phi3",), describe)


class Phi3ForSampling(DecoderForSampling):
    family = PHI3
