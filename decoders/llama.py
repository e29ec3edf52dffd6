"""Llama (Llama 2 and 3, TinyLlama, SmolLM2, ...): RMSNorm, SiLU-gated MLP, rotary positions."""
from __future__ import annotations

from decoders.family import DecoderFamily
from decoders.model import DecoderForSampling

LLAMA = DecoderFamily(
    name="llama",
    model_types=("llama",),
    norm="rms",
    activation="silu",
    gated_mlp=True,
    positions="rope",
    rope_style="half",
    layer_names={
        "input_norm": "model.layers.{i}.input_layernorm.weight",
        "q": "model.layers.{i}.self_attn.q_proj.weight",
        "k": "model.layers.{i}.self_attn.k_proj.weight",
        "v": "model.layers.{i}.self_attn.v_proj.weight",
        "o": "model.layers.{i}.self_attn.o_proj.weight",
        "post_norm": "model.layers.{i}.post_attention_layernorm.weight",
        "gate": "model.layers.{i}.mlp.gate_proj.weight",
        "up": "model.layers.{i}.mlp.up_proj.weight",
        "down": "model.layers.{i}.mlp.down_proj.weight",
    },
)


class LlamaForSampling(DecoderForSampling):
    family = LLAMA
