"""Weight quantization: transformers-neuronx's QuantizationConfig and the int8 per-channel
form the programs take.

    NeuronConfig(quant=QuantizationConfig(quant_dtype="s8", dequant_dtype="bf16"))

Every linear weight inside the decoder layers (attention and MLP products, experts and
routers included; not the embedding or the LM head) is stored as int8 [out, in] with one
f32 scale per output row, symmetric: w ~= scale[o] * q[o, i], scale[o] = max_i |w[o, i]| / 127.
A product computes (x @ q.T) * scale: XLA converts q to `dequant_dtype` inside the program
(plain HLO, any backend), pyhlo's CPU kernel widens it in registers.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from decoders.blocks.params import Kind, Param, Shard

# transformers-neuronx calls per-output-channel symmetric scaling "vector_dynamic".
METHODS = ("vector_dynamic", "per_channel_symmetric")
QUANT_DTYPES = ("s8",)


@dataclass
class QuantizationConfig:
    """How weights are quantized (transformers-neuronx's names).

    quant_dtype: the stored type ("s8"). dequant_dtype: the type products run in after
    dequantizing; None: the model's amp type (anything else must equal it). quantize_method:
    "vector_dynamic" or its plain name "per_channel_symmetric". quantize_attn: False keeps the
    attention products unquantized. no_quantize_list: parameter names (as `pyhlo inspect`
    lists them, e.g. "mlp.down.weight") kept unquantized.
    """

    quant_dtype: str = "s8"
    dequant_dtype: str | None = None
    quantize_method: str = "vector_dynamic"
    quantize_attn: bool = True
    no_quantize_list: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.quant_dtype not in QUANT_DTYPES:
            raise ValueError(f"QuantizationConfig.quant_dtype must be one of {QUANT_DTYPES}, got "
                             f"{self.quant_dtype!r}")
        if self.quantize_method not in METHODS:
            raise ValueError(f"QuantizationConfig.quantize_method must be one of {METHODS}, got "
                             f"{self.quantize_method!r}")
        if self.dequant_dtype is not None:
            from decoders.config import element_type_of_amp

            self.dequant_dtype = element_type_of_amp(self.dequant_dtype)
        self.no_quantize_list = list(self.no_quantize_list)

    def check_amp(self, amp: str) -> None:
        """A ValueError when dequant_dtype is set and is not the model's amp type."""
        if self.dequant_dtype is not None and self.dequant_dtype != amp:
            raise ValueError(f"QuantizationConfig.dequant_dtype={self.dequant_dtype!r} does not match amp={amp!r}: "
                             f"products run in the amp type; set dequant_dtype={amp!r} or leave it None")

    def quantizes(self, name: str) -> bool:
        """Whether the layer parameter `name` (a linear weight) is stored quantized."""
        if name in self.no_quantize_list:
            return False
        return self.quantize_attn or not name.startswith("attn.")

    def to_dict(self) -> dict:
        return {"quant_dtype": self.quant_dtype, "dequant_dtype": self.dequant_dtype,
                "quantize_method": self.quantize_method, "quantize_attn": self.quantize_attn,
                "no_quantize_list": list(self.no_quantize_list)}


class QuantizedWeight(NamedTuple):
    """A linear weight [out, in] as int8 values and f32 per-row scales."""

    values: np.ndarray
    scales: np.ndarray


def declare(params: list[Param], config: QuantizationConfig) -> list[Param]:
    """A layer's parameters with each linear weight `config` quantizes stored int8, followed by
    its scales (NAME.scale, f32 [out]: split with the weight's rows, whole beside a weight
    split by columns)."""
    declared = []
    for param in params:
        if param.kind is not Kind.LINEAR or param.is_head or not config.quantizes(param.name):
            declared.append(param)
            continue
        shard = Shard.REPLICATED if param.shard is Shard.ROW else param.shard
        declared += [replace(param, quantized=True),
                     replace(param, name=f"{param.name}.scale", kind=Kind.VECTOR, shape=param.shape[:1], shard=shard,
                             scale_of=param.name)]
    return declared


def quantize_per_channel(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8 q [out, in] and f32 scale [out] with weight ~= scale[:, None] * q (symmetric, per
    output row; an all-zero row gets scale 0 and q 0)."""
    weight = np.asarray(weight, dtype=np.float32)
    if weight.ndim != 2:
        raise ValueError(f"per-channel quantization takes [out, in] weights, got shape {weight.shape}")
    scale = (np.abs(weight).max(axis=1) / np.float32(127.0)).astype(np.float32)
    divisor = np.where(scale > 0, scale, np.float32(1.0))[:, None]
    q = np.clip(np.rint(weight / divisor), -127, 127).astype(np.int8)
    return q, scale


def dequantize(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """f32 weight scale[:, None] * q: what the programs multiply by."""
    return scale[:, None].astype(np.float32) * q.astype(np.float32)
