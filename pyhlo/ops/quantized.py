"""Quantized weights widened inside a program: llama.cpp's GGUF block forms.

A row of a weight [n, k] is stored in blocks of 32 values, each with an f16 scale (and for
Q4_1 an f16 minimum), as three arrays:

    Q8_0  values s8 [n, k]     w = scale * value
    Q4_0  values u8 [n, k/2]   w = scale * (nibble - 8)
    Q4_1  values u8 [n, k/2]   w = scale * nibble + min

where byte j of a Q4 block's 16 holds value j of the block in its low nibble and value
j + 16 in its high one.
"""
from __future__ import annotations

from pyhlo.ops import elementwise as ew
from pyhlo.ops.shape_ops import broadcast, concatenate, reshape
from pyhlo.scribe import HloValue
from pyhlo.shape_inference import HloShapeError

BLOCK = 32


def dequantize_blocks(values: HloValue, scales: HloValue, mins: HloValue | None = None,
                      dtype: str = "f32") -> HloValue:
    """The weight [n, k] in `dtype` (products in f32, then converted): Q8_0 from s8 values,
    Q4_0 from u8 values, Q4_1 from u8 values with `mins`."""
    n = values.dims[0] if len(values.dims) == 2 else -1
    blocks = scales.dims[1] if len(scales.dims) == 2 else -1
    per_byte = 1 if values.dtype == "s8" else 2
    if (len(values.dims) != 2 or values.dtype not in ("s8", "u8") or scales.dtype != "f16"
            or scales.dims != (n, blocks) or values.dims[1] * per_byte != blocks * BLOCK
            or (mins is not None and (values.dtype != "u8" or mins.dtype != "f16" or mins.dims != scales.dims))):
        got = [f"{v.dtype}{list(v.dims)}" for v in (values, scales, mins) if v is not None]
        raise HloShapeError(f"dequantize_blocks: need s8 values [n, k] or u8 values [n, k/2], f16 scales "
                            f"[n, k/32] (and f16 mins [n, k/32] with u8 values); got {', '.join(got)}")
    if values.dtype == "s8":
        widened = ew.convert(reshape(values, (n, blocks, BLOCK)), "f32")
    else:
        packed = reshape(values, (n, blocks, BLOCK // 2))
        high = ew.divide(packed, 16)                  # u8 division: the top nibble
        low = ew.subtract(packed, ew.multiply(high, 16))
        widened = ew.convert(concatenate([low, high], 2), "f32")
        if mins is None:
            widened = ew.subtract(widened, 8.0)

    def per_block(array: HloValue) -> HloValue:
        return broadcast(ew.convert(array, "f32"), (n, blocks, BLOCK), [0, 1])

    weight = ew.multiply(widened, per_block(scales))
    if mins is not None:
        weight = ew.add(weight, per_block(mins))
    return ew.convert(reshape(weight, (n, blocks * BLOCK)), dtype)
