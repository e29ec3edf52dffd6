"""Quantized arrays inside a program: llama.cpp's GGUF block forms for weights, and int8
rows with their own scale for KV caches.

A row of a weight [n, k] is stored in blocks of 32 values, each with an f16 scale (and for
Q4_1 an f16 minimum), as three arrays:

    Q8_0  values s8 [n, k]     w = scale * value
    Q4_0  values u8 [n, k/2]   w = scale * (nibble - 8)
    Q4_1  values u8 [n, k/2]   w = scale * nibble + min

where byte j of a Q4 block's 16 holds value j of the block in its low nibble and value
j + 16 in its high one.
"""
from __future__ import annotations

import numpy as np

from pyhlo.ops import elementwise as ew
from pyhlo.ops.reductions import reduce_max
from pyhlo.ops.shape_ops import broadcast, concatenate, reshape, slice_along
from pyhlo.scribe import HloValue
from pyhlo.shape_inference import HloShapeError

BLOCK = 32
SCALE_BYTES = 4     # a packed row's f32 scale


def dequantize_blocks(values: HloValue, scales: HloValue, mins: HloValue | None = None,
                      dtype: str = "f32") -> HloValue:
    """The weight [n, k] in `dtype` (products in f32, then converted): Q8_0 from s8 values,
    Q4_0 from u8 values, Q4_1 from u8 values with `mins`."""
    n = values.dims[0] if len(values.dims) == 2 else -1
    blocks = scales.dims[1] if len(scales.dims) == 2 else -1
    per_byte = 1 if values.dtype == "s8" else 2
    if (len(values.dims) != 2 or values.dtype not in ("s8", "u8") or scales.dtype != "f16"
            or scales.dims != (n, blocks) or values.dims[1] * per_byte != blocks * BLOCK
            or (mins is not None
                and (values.dtype != "u8" or mins.dtype != "f16" or mins.dims != scales.dims))):
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


def quantize_rows(x: HloValue) -> HloValue:
    """x [..., d] as packed int8 rows s8 [..., d + 4]: q = round(x * (1 / s)) (half to even,
    within -127..127), then the 4 bytes of the row's f32 scale s = max |x| * f32(1 / 127)
    (1 for a row of zeros), so that x is about s * q, within s / 2. Products by reciprocals
    (not divisions, which compilers turn into them) make every step exact in f32 and the
    same on every backend."""
    x = ew.convert(x, "f32")
    last = len(x.dims) - 1
    scale = ew.multiply(reduce_max(ew.abs(x), last), float(np.float32(1 / 127)))
    scale = ew.select(ew.compare(scale, 0.0, "EQ"), ew.full_like(scale, 1.0), scale)
    spread = broadcast(ew.divide(1.0, scale), x.dims, list(range(last)))
    q = x.scribe.f32[x.dims].RoundNearestEven(ew.multiply(x, spread))
    q = ew.convert(ew.maximum(ew.minimum(q, 127.0), -127.0), "s8")
    return concatenate([q, ew.bitcast_convert(scale, "s8")], last)


def dequantize_rows(packed: HloValue, dtype: str = "f32") -> HloValue:
    """Packed int8 rows s8 [..., d + 4] (quantize_rows) as s * q in `dtype` [..., d]."""
    last = len(packed.dims) - 1
    if packed.dtype != "s8" or not packed.dims or packed.dims[-1] <= SCALE_BYTES:
        raise HloShapeError(f"dequantize_rows: need packed rows s8[..., d + {SCALE_BYTES}], "
                            f"got {packed.dtype}{list(packed.dims)}")
    d = packed.dims[-1] - SCALE_BYTES
    scale = ew.bitcast_convert(slice_along(packed, last, d, d + SCALE_BYTES), "f32")
    values = ew.convert(slice_along(packed, last, 0, d), "f32")
    return ew.convert(ew.multiply(values, broadcast(scale, values.dims, list(range(last)))), dtype)
