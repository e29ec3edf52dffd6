"""Quantized weights on the host, in numpy: int8 per-channel quantization at load, and the
dequantization the programs compute, as the reference the tests compare them with."""
from __future__ import annotations

import numpy as np

from decoders.weights.stored import BLOCK, BLOCK_FORMS, BlockWeight


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


def dequantize_blocks(weight: BlockWeight) -> np.ndarray:
    """The f32 weight [out, in] a BlockWeight stands for (numpy; what the programs compute).
    A form kept as the file's bytes is read by the gguf package itself."""
    rows = weight.values.shape[0]
    if BLOCK_FORMS[weight.form].as_file:
        import gguf

        kind = gguf.GGMLQuantizationType[BLOCK_FORMS[weight.form].ggml_type]
        return gguf.quants.dequantize(weight.values, kind)
    scales = weight.scales.astype(np.float32)[:, :, None]
    if weight.form == "q8_0":
        values = weight.values.astype(np.float32).reshape(rows, -1, BLOCK)
        return (scales * values).reshape(rows, -1)
    packed = weight.values.reshape(rows, -1, BLOCK // 2)
    nibbles = np.concatenate([packed & 0xF, packed >> 4], axis=2).astype(np.float32)
    if weight.form == "q4_0":
        return (scales * (nibbles - 8)).reshape(rows, -1)
    return (scales * nibbles + weight.mins.astype(np.float32)[:, :, None]).reshape(rows, -1)
