"""What a family description is made of: a config reader and the rotary frequency tables.

A family (one file in families/) is a `Family`: the model types it runs and a
`describe(config, fuse_qkv)` function that reads its config keys and returns the pieces
(`Decoder`) with their checkpoint names.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from decoders.blocks.attention import Rotary
from decoders.blocks.layer import Decoder
from decoders.config import NotSupportedYet

_MISSING = object()


class ConfigReader:
    """A checkpoint's config.json, read by key with alternatives and clear errors."""

    def __init__(self, config: dict, family: str):
        self.config = config
        self.family = family

    def get(self, *keys: str, default: Any = _MISSING) -> Any:
        """The value of the first of `keys` that is set; without a default, one must be."""
        for key in keys:
            if self.config.get(key) is not None:
                return self.config[key]
        if default is _MISSING:
            raise ValueError(f"config.json has no {' or '.join(map(repr, keys))}; a {self.family} model "
                             "needs it")
        return default

    def refuse(self, key: str, unsupported: Callable[[Any], bool], why: str) -> None:
        """NotSupportedYet when `key` is set to a value the pieces do not build."""
        value = self.config.get(key)
        if value is not None and unsupported(value):
            raise NotSupportedYet(f"{self.family}: {key}={value!r} is not supported yet ({why})")

    def rope(self) -> dict:
        """Rotary settings: older configs say rope_theta + rope_scaling, newer ones put both
        (and partial_rotary_factor) in rope_parameters."""
        return dict(self.config.get("rope_parameters") or self.config.get("rope_scaling") or {})


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    describe: Callable[[ConfigReader, bool], Decoder]


def rope_inverse_frequencies(scaling: dict, theta: float, dim: int) -> tuple[float, ...]:
    """Rotary inverse frequencies over `dim` features, with linear or llama3 scaling when asked for."""
    inv_freq = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return tuple(float(f) for f in inv_freq.astype(np.float32))
    if rope_type == "linear":       # positions divided by the factor (Gemma 3's global layers)
        return tuple(float(f) for f in (inv_freq / float(scaling["factor"])).astype(np.float32))
    if rope_type != "llama3":
        raise NotSupportedYet(f"rope_scaling type {rope_type!r} is not supported yet (default, linear and "
                              "llama3 are)")
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
    return tuple(float(f) for f in np.where(is_medium, smoothed, scaled).astype(np.float32))


def longrope(scaling: dict, theta: float, dim: int, max_positions: int) -> Rotary:
    """LongRoPE (Phi-3.5, Phi-4-mini) as HF computes it: the default frequencies over `dim`
    features divided by short_factor (by long_factor past original_max_position_embeddings),
    cos and sin scaled by attention_factor (by default sqrt(1 + ln(factor) / ln(original)),
    factor max_positions / original unless the config gives it)."""
    original = int(scaling["original_max_position_embeddings"])
    factors = {}
    for key in ("short_factor", "long_factor"):
        factors[key] = np.asarray(scaling.get(key, ()), np.float64)
        if factors[key].shape != (dim // 2,):
            raise ValueError(f"rope_scaling {key} has {factors[key].size} values; LongRoPE over {dim} rotary "
                             f"features needs {dim // 2}")
    factor = float(scaling.get("factor") or max_positions / original)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    base = theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)

    def frequencies(ext: np.ndarray) -> tuple[float, ...]:
        return tuple(float(f) for f in (1.0 / (ext * base)).astype(np.float32))

    return Rotary(frequencies(factors["short_factor"]), scale=float(attention_factor),
                  long_inv_freq=frequencies(factors["long_factor"]), original_context=original)
