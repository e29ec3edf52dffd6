"""GGUF block forms dequantized inside a program from the file's own bytes.

A weight [n, k] stays u8 [n, k / values * bytes]: each row its blocks, exactly as llama.cpp
writes them (ggml-common.h), and is unpacked here with shifts and masks:

    Q5_0  32 values, 22 bytes: f16 d, 32 high bits, 16 bytes of low nibbles; w = d * (q - 16)
    Q5_1  32 values, 24 bytes: f16 d, f16 m, high bits, nibbles;             w = d * q + m
    Q2_K  256 values, 84 bytes: 16 scale|min nibbles, 64 bytes of 2-bit values, f16 d, dmin
    Q3_K  256 values, 110 bytes: 32 bytes of high bits, 64 of 2-bit values, 12 of 6-bit
          scales, f16 d; w = d * (scale - 32) * (q - 4 * (1 - high bit))
    Q4_K  256 values, 144 bytes: f16 d, dmin, 12 bytes of 6-bit scales and minimums for
          8 sub-blocks of 32, 128 bytes of nibbles; w = d * scale * q - dmin * min
    Q5_K  256 values, 176 bytes: as Q4_K with 32 bytes of high bits before the nibbles
    Q6_K  256 values, 210 bytes: 128 bytes of low nibbles, 64 of 2-bit highs, 16 s8 scales
          (sub-blocks of 16), f16 d; w = d * scale * (q - 32)
    Q8_0  32 values, 34 bytes: f16 d, 32 s8 values; w = d * q
    Q4_0  32 values, 18 bytes: f16 d, 16 bytes of nibbles; w = d * (q - 8)
    Q4_1  32 values, 20 bytes: f16 d, f16 m, nibbles; w = d * q + m
    IQ4_NL 32 values, 18 bytes: f16 d, 16 bytes of nibbles; w = d * KVALUES[q]
    IQ4_XS 256 values, 136 bytes: f16 d, 2 + 4 bytes of 6-bit scales, 128 bytes of nibbles
          (sub-blocks of 32, each as IQ4_NL's); w = d * (scale - 32) * KVALUES[q]

Every product is taken in f32 in the order of the `gguf` package's numpy dequantization
(`gguf.quants.dequantize`), and each is exact in f32 (an f16 times integers of at most 13
bits), so the weights read here equal that package's bit for bit.

A weight whose rows come in several forms (llama.cpp's Q4_K_M gives layers of one weight
different types, and a fused q|k|v may join them) keeps each row in its own form: u8 [n,
widest row + ROW_TAIL] read as one run of bytes, the rows' blocks back to back from the start,
then each row's first byte (u32, little-endian), then the code of each row's form
(ROW_CODES); what the narrower rows leave unused lies at the end, between the last row and
the offsets (pack_mixed_rows, dequantize_gguf_rows). Rows padded each to the widest were
read at half the speed: the padding streamed from memory with the rows around it.
"""
from __future__ import annotations

import numpy as np

from pyhlo.ops import elementwise as ew
from pyhlo.ops.shape_ops import broadcast, concatenate, iota, reshape, slice_along
from pyhlo.scribe import HloValue
from pyhlo.shape_inference import HloShapeError

# GGML type -> (values per block, bytes per block)
LAYOUTS = {"Q5_0": (32, 22), "Q5_1": (32, 24), "Q2_K": (256, 84), "Q3_K": (256, 110),
           "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210), "IQ4_NL": (32, 18),
           "IQ4_XS": (256, 136), "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20)}
# The code a row of mixed forms names its form by (its last byte), as the CPU kernels read it.
ROW_CODES = ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "Q8_0", "Q4_0",
             "Q4_1")
# Bytes of rows of mixed forms past the widest row: a row's offset (u32) and its form's code.
ROW_TAIL = 5
# The 16 values an IQ4 nibble stands for (ggml-common.h: kvalues_iq4nl).
KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def dequantize_gguf(data: HloValue, ggml_type: str, dtype: str = "f32") -> HloValue:
    """The weight [n, k] in `dtype` (computed in f32, then converted) from its rows of GGUF
    blocks u8 [n, k / values * bytes] of `ggml_type` (one of LAYOUTS)."""
    if ggml_type not in LAYOUTS:
        raise HloShapeError(f"dequantize_gguf: no unpacking of {ggml_type!r}; known: {', '.join(LAYOUTS)}")
    values, size = LAYOUTS[ggml_type]
    if data.dtype != "u8" or len(data.dims) != 2 or data.dims[1] % size:
        raise HloShapeError(f"dequantize_gguf: {ggml_type} needs u8 [n, whole {size}-byte blocks], "
                            f"got {data.dtype}{list(data.dims)}")
    n, blocks = data.dims[0], data.dims[1] // size
    weight = _UNPACK[ggml_type](reshape(data, (n, blocks, size)))
    return ew.convert(reshape(weight, (n, blocks * values)), dtype)


def row_bytes(ggml_type: str, k: int) -> int:
    """Bytes of a row of k values in `ggml_type`."""
    values, size = LAYOUTS[ggml_type]
    return k // values * size


def mixed_rows_width(ggml_types: tuple[str, ...], k: int) -> int:
    """The second dimension of rows of k values in any of `ggml_types` (module docstring)."""
    return max(row_bytes(t, k) for t in ggml_types) + ROW_TAIL


def pack_mixed_rows(rows: list[tuple[str, np.ndarray]], k: int, ggml_types: tuple[str, ...]) -> np.ndarray:
    """Rows of k values, each `(GGML type, u8 [row bytes])` (or several rows of one type, u8
    [rows, row bytes]), in that order, as u8 [n, mixed_rows_width(ggml_types, k)]."""
    parts = [(t, np.asarray(r, np.uint8).reshape(-1, row_bytes(t, k))) for t, r in rows]
    n = sum(len(r) for _, r in parts)
    width = mixed_rows_width(ggml_types, k)
    body = n * (width - ROW_TAIL)
    if body > np.iinfo(np.uint32).max:
        raise ValueError(f"pack_mixed_rows: {body} bytes of rows exceed the u32 offsets; split the weight")
    flat = np.zeros(n * width, np.uint8)
    offsets = np.zeros(n, "<u4")
    codes = np.zeros(n, np.uint8)
    at = row = 0
    for ggml_type, data in parts:
        if ggml_type not in ggml_types:
            raise ValueError(f"pack_mixed_rows: a {ggml_type} row among rows of {'/'.join(ggml_types)}")
        size = data.size
        flat[at:at + size] = data.reshape(-1)
        offsets[row:row + len(data)] = at + np.arange(len(data)) * data.shape[1]
        codes[row:row + len(data)] = ROW_CODES.index(ggml_type)
        at, row = at + size, row + len(data)
    flat[body:body + 4 * n] = offsets.view(np.uint8)
    flat[body + 4 * n:] = codes
    return flat.reshape(n, width)


def unpack_mixed_rows(data: np.ndarray, k: int) -> list[tuple[str, np.ndarray]]:
    """pack_mixed_rows' rows back: (GGML type, u8 [row bytes]) each."""
    n, width = data.shape
    flat = data.reshape(-1)
    body = n * (width - ROW_TAIL)
    offsets = flat[body:body + 4 * n].view("<u4")
    types = [ROW_CODES[c] for c in flat[body + 4 * n:]]
    return [(t, flat[o:o + row_bytes(t, k)]) for t, o in zip(types, offsets)]


def dequantize_gguf_rows(data: HloValue, ggml_types: tuple[str, ...], k: int, dtype: str = "f32") -> HloValue:
    """The weight [n, k] in `dtype` from rows each in one of `ggml_types`, as pack_mixed_rows
    lays them out. Each row is gathered from its offset, then each form's reading of every row
    kept where the row's code names it."""
    width = mixed_rows_width(ggml_types, k)
    if data.dtype != "u8" or len(data.dims) != 2 or data.dims[1] != width:
        raise HloShapeError(f"dequantize_gguf_rows: rows of {'/'.join(ggml_types)} of {k} values need u8 "
                            f"[n, {width}], got {data.dtype}{list(data.dims)}")
    n, widest = data.dims[0], width - ROW_TAIL
    flat = reshape(data, (n * width,))
    body = n * widest
    offsets = ew.convert(ew.bitcast_convert(reshape(slice_along(flat, 0, body, body + 4 * n), (n, 4)), "u32"),
                         "s32")
    codes = broadcast(slice_along(flat, 0, body + 4 * n, n * width), (n, k), [0])
    # The rows' bytes, zeros after them, so that the last row's gather of `widest` bytes fits
    # (a gather moves a start that would overrun the operand).
    zeros = ew.constant(data.scribe, "u8", 0, (widest,))
    padded = concatenate([slice_along(flat, 0, 0, body), zeros], 0)
    numbers = dict(offset_dims=[1], collapsed_slice_dims=[], start_index_map=[0], index_vector_dim=1)
    rows = data.scribe.u8[(n, widest)].Gather(padded, reshape(offsets, (n, 1)),
                                              gather_dimension_numbers=numbers, gather_slice_sizes=[widest])
    weight = None
    for ggml_type in ggml_types:
        read = dequantize_gguf(slice_along(rows, 1, 0, row_bytes(ggml_type, k)), ggml_type)
        weight = read if weight is None else ew.select(
            ew.compare(codes, ROW_CODES.index(ggml_type), "EQ"), read, weight)
    return ew.convert(weight, dtype)


def _bytes(blocks: HloValue, start: int, stop: int) -> HloValue:
    """Bytes start:stop of every block: u8 [n, b, stop - start]."""
    return slice_along(blocks, 2, start, stop)


def _f16(blocks: HloValue, start: int) -> HloValue:
    """The f16 at byte `start` of every block, as f32 [n, b]."""
    return ew.convert(ew.bitcast_convert(_bytes(blocks, start, start + 2), "f16"), "f32")


def _fields(data: HloValue, width: int, count: int, mask: int) -> HloValue:
    """data [..., m] u8 split into `count` fields of `width` bits, lowest first: u8
    [..., count, m], field i of byte j at [..., i, j]."""
    lead = data.dims[:-1]
    dims = (*lead, count, data.dims[-1])
    spread = broadcast(data, dims, [*range(len(lead)), len(lead) + 1])
    shifts = ew.multiply(iota(data.scribe, "u8", dims, len(lead)), width)
    return ew.bitwise_and(ew.shift_right_logical(spread, shifts), mask)


def _per_value(scales: HloValue, group: int) -> HloValue:
    """f32 [n, b, s] -> [n, b, s * group]: each sub-block's number over its `group` values."""
    n, b, s = scales.dims
    return reshape(broadcast(scales, (n, b, s, group), [0, 1, 2]), (n, b, s * group))


def _times(value: HloValue, per_block: HloValue) -> HloValue:
    """value [n, b, v] times a number per block [n, b]."""
    return ew.multiply(value, broadcast(per_block, value.dims, [0, 1]))


def _f32(x: HloValue) -> HloValue:
    return ew.convert(x, "f32")


def _nibbles32(blocks: HloValue, start: int) -> HloValue:
    """A 32-value block's 16 bytes of nibbles at `start`: low nibbles are values 0-15, high
    ones 16-31. u8 [n, b, 32]."""
    n, b, _ = blocks.dims
    return reshape(_fields(_bytes(blocks, start, start + 16), 4, 2, 0xF), (n, b, 32))


def _bits32(blocks: HloValue, start: int) -> HloValue:
    """32 bits at `start` (a little-endian u32), one a value: bit j is value j's. u8 [n, b, 32]."""
    n, b, _ = blocks.dims
    bits = _fields(_bytes(blocks, start, start + 4), 1, 8, 1)      # [n, b, bit, byte]
    return reshape(_byte_major(bits), (n, b, 32))


def _byte_major(fields: HloValue) -> HloValue:
    """[..., field, byte] -> [..., byte, field]: value j is field j % count of byte j // count."""
    rank = len(fields.dims)
    order = list(range(rank - 2)) + [rank - 1, rank - 2]
    dims = tuple(fields.dims[i] for i in order)
    return fields.scribe.u8[dims].Transpose(fields, dimensions=order)


def _q5_0(blocks: HloValue) -> HloValue:
    q = ew.bitwise_or(_nibbles32(blocks, 6), ew.shift_left(_bits32(blocks, 2), 4))
    centred = _f32(ew.subtract(ew.convert(q, "s8"), 16))
    return _times(centred, _f16(blocks, 0))


def _q5_1(blocks: HloValue) -> HloValue:
    q = ew.bitwise_or(_nibbles32(blocks, 8), ew.shift_left(_bits32(blocks, 4), 4))
    scaled = _times(_f32(q), _f16(blocks, 0))
    return ew.add(scaled, broadcast(_f16(blocks, 2), scaled.dims, [0, 1]))


def _scales_and_mins(blocks: HloValue, start: int) -> tuple[HloValue, HloValue]:
    """Q4_K / Q5_K: the 8 sub-blocks' 6-bit scales and minimums from 12 bytes at `start`:
    bytes 0-3 hold scales 0-3 (low 6 bits) and the top bits of scales 4-7, bytes 4-7 the
    same for minimums, bytes 8-11 the low nibbles of scales 4-7 and (high) minimums 4-7.
    u8 [n, b, 8] each."""
    first, second, third = (_bytes(blocks, start + 4 * i, start + 4 * i + 4) for i in range(3))
    top = 0x30

    def high_two(x: HloValue) -> HloValue:
        return ew.bitwise_and(ew.shift_right_logical(x, 2), top)

    scales = concatenate([ew.bitwise_and(first, 0x3F),
                          ew.bitwise_or(ew.bitwise_and(third, 0x0F), high_two(first))], 2)
    mins = concatenate([ew.bitwise_and(second, 0x3F),
                        ew.bitwise_or(ew.shift_right_logical(third, 4), high_two(second))], 2)
    return scales, mins


def _k_quant(blocks: HloValue, q: HloValue) -> HloValue:
    """Q4_K / Q5_K: w = (d * scale) * q - dmin * min, q u8 [n, b, 256]."""
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    scales, mins = _scales_and_mins(blocks, 4)
    scale = _per_value(_times(_f32(scales), d), 32)
    low = _per_value(_times(_f32(mins), dmin), 32)
    return ew.subtract(ew.multiply(scale, _f32(q)), low)


def _k_nibbles(blocks: HloValue, start: int) -> HloValue:
    """128 bytes of nibbles at `start`, in 4 runs of 32 bytes: run r's low nibbles are
    sub-block 2r, its high ones 2r + 1. u8 [n, b, 256]."""
    n, b, _ = blocks.dims
    runs = reshape(_bytes(blocks, start, start + 128), (n, b, 4, 32))
    return reshape(_fields(runs, 4, 2, 0xF), (n, b, 256))


def _q4_k(blocks: HloValue) -> HloValue:
    return _k_quant(blocks, _k_nibbles(blocks, 16))


def _q5_k(blocks: HloValue) -> HloValue:
    n, b, _ = blocks.dims
    # 32 bytes of high bits: bit j of byte i is the high bit of value i of sub-block j.
    high = reshape(_fields(_bytes(blocks, 16, 48), 1, 8, 1), (n, b, 256))
    return _k_quant(blocks, ew.bitwise_or(_k_nibbles(blocks, 48), ew.shift_left(high, 4)))


def _q6_k(blocks: HloValue) -> HloValue:
    n, b, _ = blocks.dims
    # Two halves of 128 values: 64 bytes of nibbles (low: values 0-63, high: 64-127) and
    # 32 bytes of 2-bit pairs (pair i of byte j: value 32 i + j).
    low = reshape(_fields(reshape(_bytes(blocks, 0, 128), (n, b, 2, 64)), 4, 2, 0xF), (n, b, 256))
    high = reshape(_fields(reshape(_bytes(blocks, 128, 192), (n, b, 2, 32)), 2, 4, 3), (n, b, 256))
    q = ew.subtract(ew.convert(ew.bitwise_or(low, ew.shift_left(high, 4)), "s8"), 32)
    scales = _f32(ew.bitcast_convert(_bytes(blocks, 192, 208), "s8"))
    return ew.multiply(_per_value(_times(scales, _f16(blocks, 208)), 16), _f32(q))


def _q2_k(blocks: HloValue) -> HloValue:
    n, b, _ = blocks.dims
    packed = _bytes(blocks, 0, 16)           # 16 sub-blocks of 16: scale low nibble, min high
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    scale = _per_value(_times(_f32(ew.bitwise_and(packed, 0xF)), d), 16)
    low = _per_value(_times(_f32(ew.shift_right_logical(packed, 4)), dmin), 16)
    # 2 runs of 32 bytes: pair i of byte j of run r is value 128 r + 32 i + j.
    q = reshape(_fields(reshape(_bytes(blocks, 16, 80), (n, b, 2, 32)), 2, 4, 3), (n, b, 256))
    return ew.subtract(ew.multiply(scale, _f32(q)), low)


def _q3_k(blocks: HloValue) -> HloValue:
    n, b, _ = blocks.dims
    # 16 6-bit scales: low nibbles from bytes 96-103 (low nibbles: scales 0-7, high: 8-15),
    # top 2 bits from bytes 104-107 (pair i of byte j: scale 4 i + j).
    low = reshape(_fields(_bytes(blocks, 96, 104), 4, 2, 0xF), (n, b, 16))
    top = reshape(_fields(_bytes(blocks, 104, 108), 2, 4, 3), (n, b, 16))
    scales = ew.subtract(ew.convert(ew.bitwise_or(low, ew.shift_left(top, 4)), "s8"), 32)
    scale = _per_value(_times(_f32(scales), _f16(blocks, 108)), 16)
    q = reshape(_fields(reshape(_bytes(blocks, 32, 96), (n, b, 2, 32)), 2, 4, 3), (n, b, 256))
    # High bit i of byte j (of 32) belongs to value 32 i + j; a clear bit subtracts 4.
    high = reshape(_fields(_bytes(blocks, 0, 32), 1, 8, 1), (n, b, 256))
    minus = ew.shift_left(ew.subtract(1, high), 2)
    signed = ew.subtract(ew.convert(q, "s8"), ew.convert(minus, "s8"))
    return ew.multiply(scale, _f32(signed))


def _nonlinear(q: HloValue) -> HloValue:
    """KVALUES[q] for nibbles q u8 [...], as f32."""
    table = ew.constant(q.scribe, "f32", np.array(KVALUES, np.float32), (len(KVALUES),))
    numbers = dict(offset_dims=[], collapsed_slice_dims=[0], start_index_map=[0],
                   index_vector_dim=len(q.dims))
    return q.scribe.f32[q.dims].Gather(table, ew.convert(q, "s32"), gather_dimension_numbers=numbers,
                                       gather_slice_sizes=[1])


def _iq4_nl(blocks: HloValue) -> HloValue:
    return _times(_nonlinear(_nibbles32(blocks, 2)), _f16(blocks, 0))


def _iq4_xs(blocks: HloValue) -> HloValue:
    n, b, _ = blocks.dims
    # 8 6-bit scales: low nibbles from bytes 4-7 (byte i: scales 2i, 2i + 1), top 2 bits from
    # the little-endian u16 at bytes 2-3 (bits 2j, 2j + 1: scale j).
    low = reshape(_byte_major(_fields(_bytes(blocks, 4, 8), 4, 2, 0xF)), (n, b, 8))
    top = reshape(_byte_major(_fields(_bytes(blocks, 2, 4), 2, 4, 3)), (n, b, 8))
    scales = ew.subtract(ew.convert(ew.bitwise_or(low, ew.shift_left(top, 4)), "s8"), 32)
    scale = _per_value(_times(_f32(scales), _f16(blocks, 0)), 32)
    # 8 runs of 16 bytes, one a sub-block: low nibbles values 0-15, high ones 16-31.
    runs = reshape(_bytes(blocks, 8, 136), (n, b, 8, 16))
    q = reshape(_fields(runs, 4, 2, 0xF), (n, b, 256))
    return ew.multiply(scale, _nonlinear(q))


def _q8_0(blocks: HloValue) -> HloValue:
    return _times(_f32(ew.bitcast_convert(_bytes(blocks, 2, 34), "s8")), _f16(blocks, 0))


def _q4_0(blocks: HloValue) -> HloValue:
    return _times(_f32(ew.subtract(ew.convert(_nibbles32(blocks, 2), "s8"), 8)), _f16(blocks, 0))


def _q4_1(blocks: HloValue) -> HloValue:
    scaled = _times(_f32(_nibbles32(blocks, 4)), _f16(blocks, 0))
    return ew.add(scaled, broadcast(_f16(blocks, 2), scaled.dims, [0, 1]))


_UNPACK = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q2_K": _q2_k,
           "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k,
           "Q6_K": _q6_k, "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs}
