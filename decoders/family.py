"""A model family is a short description over one shared decoder block.

`DecoderFamily` says what differs between decoder LLMs (norm, activation,
positional scheme, biases, weight names); `ModelDims` holds one checkpoint's
hyper-parameters. `decoders/graph.py` builds every program from these two.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from decoders.config import NotSupportedYet


@dataclass(frozen=True)
class DecoderFamily:
    name: str
    model_types: tuple[str, ...]
    norm: str = "rms"                 # "rms" | "layer"
    activation: str = "silu"          # applied to the gate of a gated MLP
    gated_mlp: bool = True
    positions: str = "rope"           # "rope" | "alibi" | "learned"
    rope_style: str = "half"          # "half" (Llama, NeoX) | "interleaved" (GPT-J)
    qkv_bias: bool = False
    # Checkpoint tensor names: {i} is the layer index.
    embed_name: str = "model.embed_tokens.weight"
    final_norm_name: str = "model.norm.weight"
    lm_head_name: str = "lm_head.weight"
    layer_names: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelDims:
    """Hyper-parameters of one checkpoint, read from its config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    norm_eps: float
    max_positions: int
    tie_word_embeddings: bool
    inv_freq: tuple[float, ...]
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)


def _require(config: dict, key: str):
    if config.get(key) is None:
        raise ValueError(f"config.json has no {key!r}; it is needed to build the model")
    return config[key]


def rope_inverse_frequencies(config: dict, head_dim: int) -> np.ndarray:
    """Rotary inverse frequencies, with llama3 scaling when the config asks for it."""
    # Older configs say rope_theta + rope_scaling; newer ones put both in rope_parameters.
    scaling = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = float(scaling.get("rope_theta") or config.get("rope_theta") or 10000.0)
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq.astype(np.float32)
    if rope_type != "llama3":
        raise NotSupportedYet(f"rope_scaling type {rope_type!r} is not supported yet (default and llama3 are)")
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def dims_from_config(config: dict) -> ModelDims:
    hidden = int(_require(config, "hidden_size"))
    n_heads = int(_require(config, "num_attention_heads"))
    head_dim = int(config.get("head_dim") or hidden // n_heads)
    n_kv_heads = int(config.get("num_key_value_heads") or n_heads)
    if n_heads % n_kv_heads:
        raise ValueError(
            f"num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv_heads}"
        )
    return ModelDims(
        vocab_size=int(_require(config, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_require(config, "intermediate_size")),
        n_layers=int(_require(config, "num_hidden_layers")),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        norm_eps=float(config.get("rms_norm_eps") or config.get("layer_norm_eps") or 1e-6),
        max_positions=int(config.get("max_position_embeddings") or 2048),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        inv_freq=tuple(float(f) for f in rope_inverse_frequencies(config, head_dim)),
        bos_token_id=config.get("bos_token_id"),
        eos_token_id=config.get("eos_token_id"),
    )
