"""Weight quantization: transformers-neuronx's QuantizationConfig and the int8 per-channel
form the programs take.

    NeuronConfig(quant=QuantizationConfig(quant_dtype="s8", dequant_dtype="bf16"))

Every linear weight inside the decoder layers (attention and MLP products, experts and
routers included; not the embedding or the LM head) is stored as int8 [out, in] with one
f32 scale per output row, symmetric: w ~= scale[o] * q[o, i], scale[o] = max_i |w[o, i]| / 127.
A product computes (x @ q.T) * scale: XLA converts q to `dequant_dtype` inside the program
(plain HLO, any backend), pyhlo's CPU kernel widens it in registers.

GGUF files keep their own forms (BLOCK_FORMS): llama.cpp's Q8_0, Q4_0 and Q4_1 store each row
in blocks of 32 values with an f16 scale per block (and for Q4_1 an f16 minimum). A model
loaded from such a file runs them as stored (`BlockWeight`: the same bits, the values, scales
and minimums as three arrays), dequantized inside the program or pyhlo's CPU kernel.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from decoders.blocks.params import Kind, Param, Shard

log = logging.getLogger("pyhlo")

# transformers-neuronx calls per-output-channel symmetric scaling "vector_dynamic".
METHODS = ("vector_dynamic", "per_channel_symmetric")
QUANT_DTYPES = ("s8",)
# GGUF block forms run as stored: the values' element type and how many values a byte holds.
BLOCK_FORMS = {"q8_0": ("s8", 1), "q4_0": ("u8", 2), "q4_1": ("u8", 2)}
BLOCK = 32


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


class BlockWeight(NamedTuple):
    """A linear weight [out, in] in a GGUF block form: `values` s8 [out, in] (q8_0) or u8
    [out, in/2] (q4_0, q4_1: byte j of a block's 16 holds value j in its low nibble and
    value j+16 in its high one), `scales` f16 [out, in/32], `mins` f16 [out, in/32] (q4_1)."""

    form: str
    values: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None = None


def declare(params: list[Param], config: QuantizationConfig | None, blocks: dict[str, str] | None = None
            ) -> list[Param]:
    """Parameters with each linear weight stored quantized, followed by the arrays that
    belong to it (NAME.scale, NAME.min): in the GGUF block form `blocks` names for it, else,
    for a layer weight `config` quantizes, int8 with its f32 scales [out] (split with the
    weight's rows, whole beside a weight split by columns)."""
    declared = []
    for param in params:
        form = (blocks or {}).get(param.name)
        if form is not None:
            weight = replace(param, quant=form)
            width = param.shape[1] // BLOCK
            declared += [weight, replace(weight, name=f"{param.name}.scale", kind=Kind.TABLE,
                                         shape=(param.shape[0], width), part_of=param.name)]
            if form == "q4_1":
                declared.append(replace(weight, name=f"{param.name}.min", kind=Kind.TABLE,
                                        shape=(param.shape[0], width), part_of=param.name))
            continue
        if config is None or param.kind is not Kind.LINEAR or param.is_head or not config.quantizes(param.name):
            declared.append(param)
            continue
        weight = replace(param, quant="s8")
        shard = Shard.REPLICATED if param.shard is Shard.ROW else param.shard
        declared += [weight, replace(weight, name=f"{param.name}.scale", kind=Kind.VECTOR, shape=param.shape[:1],
                                     shard=shard, part_of=param.name)]
    return declared


def stored_dims(param: Param) -> tuple[int, ...]:
    """The dims of a parameter as stored: a GGUF block weight's values are [out, in / values
    per byte]; anything else, its logical shape."""
    if param.quant in BLOCK_FORMS and not param.part_of:
        return (param.shape[0], param.shape[1] // BLOCK_FORMS[param.quant][1])
    return param.shape


def stored_dtype(param: Param) -> str | None:
    """The element type of a quantized weight or one of its arrays; None: not quantized."""
    if param.quant is None:
        return None
    if param.quant == "s8":
        return "f32" if param.part_of else "s8"
    return "f16" if param.part_of else BLOCK_FORMS[param.quant][0]


def dequantize_blocks(weight: BlockWeight) -> np.ndarray:
    """The f32 weight [out, in] a BlockWeight stands for (numpy; what the programs compute)."""
    rows = weight.values.shape[0]
    scales = weight.scales.astype(np.float32)[:, :, None]
    if weight.form == "q8_0":
        values = weight.values.astype(np.float32).reshape(rows, -1, BLOCK)
        return (scales * values).reshape(rows, -1)
    packed = weight.values.reshape(rows, -1, BLOCK // 2)
    nibbles = np.concatenate([packed & 0xF, packed >> 4], axis=2).astype(np.float32)
    if weight.form == "q4_0":
        return (scales * (nibbles - 8)).reshape(rows, -1)
    return (scales * nibbles + weight.mins.astype(np.float32)[:, :, None]).reshape(rows, -1)


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


def gguf_block_forms(checkpoint, layer_params: list[Param], head_params: list[Param], n_layers: int
                     ) -> dict[str, str]:
    """The linear weights `checkpoint` stores in one GGUF block form in every layer (and the LM
    head), by parameter name: those run as stored. Logs the quantized ones that are widened at
    load instead (other GGML types, or a form that differs between layers)."""
    forms, widened = {}, set()
    for param, layers in [(p, range(n_layers)) for p in layer_params] + [(p, [None]) for p in head_params]:
        if param.kind is not Kind.LINEAR:
            continue
        names = [name for layer in layers for name in param.source.resolve(layer, checkpoint.__contains__)]
        found = {checkpoint.block_form(name) for name in names if name in checkpoint}
        if len(found) == 1 and None not in found and not param.source.transforms and param.shape[1] % BLOCK == 0:
            forms[param.name] = found.pop()
            continue
        types = {checkpoint.quant_type(name) for name in names if name in checkpoint}
        widened |= {t for t in types if t not in (None, "F32", "F16", "BF16")} | ({"mixed"} if len(found) > 1 else set())
    if widened:
        log.info("GGUF weights stored %s are widened at load; Q8_0, Q4_0 and Q4_1 run as stored",
                 ", ".join(sorted(widened)))
    return forms
