"""Write weights in GGUF K-quant blocks (Q4_K, Q5_K, Q6_K) and IQ4_NL for test files: the
gguf package reads these types but does not write them. A plain round-to-nearest quantizer, not
llama.cpp's search for the best scales: any valid blocks serve the tests, which compare a
file kept as stored with the same file widened at load."""
from __future__ import annotations

import gguf
import numpy as np

K = 256


def quantize(array: np.ndarray, kind: gguf.GGMLQuantizationType) -> np.ndarray:
    """array [..., k] f32 as GGUF blocks of `kind`, u8 [..., k / values * bytes]."""
    writers = {gguf.GGMLQuantizationType.Q4_K: _q4_k, gguf.GGMLQuantizationType.Q5_K: _q5_k,
               gguf.GGMLQuantizationType.Q6_K: _q6_k, gguf.GGMLQuantizationType.IQ4_NL: _iq4_nl}
    if kind not in writers:
        return gguf.quants.quantize(array.astype(np.float32), kind)
    rows = array.reshape(-1, array.shape[-1]).astype(np.float32)
    values = gguf.GGML_QUANT_SIZES[kind][0]
    if rows.shape[1] % values:
        raise ValueError(f"{kind.name} needs rows of whole {values}-value blocks, got {rows.shape[1]}")
    blocks = writers[kind](rows.reshape(-1, values))
    return blocks.reshape(*array.shape[:-1], -1)


def _f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x as f16 bytes [n, 2], and its f16 value as f32 (1 where it is 0, to divide by)."""
    half = x.astype(np.float16)
    value = half.astype(np.float32)
    return half.reshape(-1, 1).view(np.uint8), np.where(value == 0, 1, value)


def _scales_and_mins(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 6-bit scales and minimums per block [n, 8] packed into 12 bytes as ggml packs them."""
    low = (sc[:, :4] | ((sc[:, 4:] >> 4) << 6)).astype(np.uint8)
    mid = (mn[:, :4] | ((mn[:, 4:] >> 4) << 6)).astype(np.uint8)
    high = ((sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)).astype(np.uint8)
    return np.concatenate([low, mid, high], axis=1)


def _asymmetric(blocks: np.ndarray, levels: int):
    """Sub-blocks of 32 with a 6-bit scale and minimum each: the bytes of d and dmin, the
    scales and minimums [n, 8] and the values q [n, 8, 32] in 0..levels."""
    sub = blocks.reshape(-1, 8, 32)
    low = np.minimum(sub.min(axis=2), 0)
    spread = (sub.max(axis=2) - low) / levels
    d_bytes, d = _f16(spread.max(axis=1) / 63)
    dmin_bytes, dmin = _f16((-low).max(axis=1) / 63)
    sc = np.clip(np.rint(spread / d[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(-low / dmin[:, None]), 0, 63).astype(np.uint8)
    step = (d[:, None] * sc)[:, :, None]
    shifted = sub + (dmin[:, None] * mn)[:, :, None]
    q = np.clip(np.rint(shifted / np.where(step == 0, 1, step)), 0, levels).astype(np.uint8)
    return d_bytes, dmin_bytes, _scales_and_mins(sc, mn), q


def _nibbles(q: np.ndarray) -> np.ndarray:
    """q [n, 8, 32] (low 4 bits) as 4 runs of 32 bytes: sub-block 2r low, 2r + 1 high."""
    pairs = (q & 0xF).reshape(-1, 4, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128).astype(np.uint8)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _asymmetric(blocks, 15)
    return np.concatenate([d, dmin, scales, _nibbles(q)], axis=1)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _asymmetric(blocks, 31)
    high = ((q >> 4) & 1).astype(np.uint8)                       # [n, sub-block j, value i]
    bits = (high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1).astype(np.uint8)
    return np.concatenate([d, dmin, scales, bits, _nibbles(q)], axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    sub = blocks.reshape(-1, 16, 16)
    spread = np.abs(sub).max(axis=2) / 31
    d_bytes, d = _f16(spread.max(axis=1) / 127)
    sc = np.clip(np.rint(spread / d[:, None]), 0, 127).astype(np.int8)
    step = (d[:, None] * sc)[:, :, None]
    q = (np.clip(np.rint(sub / np.where(step == 0, 1, step)), -32, 31) + 32).astype(np.uint8).reshape(-1, 256)
    # Each half of 128 values: value r's low nibble in byte r % 64 (low, then high nibbles),
    # its top 2 bits in byte r % 32, pair r // 32.
    halves = q.reshape(-1, 2, 128)
    low = halves & 0xF
    ql = (low[:, :, :64] | (low[:, :, 64:] << 4)).reshape(-1, 128)
    top = (halves >> 4).reshape(-1, 2, 4, 32)
    qh = (top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)).reshape(-1, 64)
    return np.concatenate([ql.astype(np.uint8), qh.astype(np.uint8), sc.view(np.uint8), d_bytes], axis=1)


def _iq4_nl(blocks: np.ndarray) -> np.ndarray:
    table = np.array(gguf.quants.IQ4_NL.kvalues, np.float32)
    d_bytes, d = _f16(np.abs(blocks).max(axis=1) / 127)
    q = np.abs(blocks[:, :, None] / d[:, None, None] - table).argmin(axis=2).astype(np.uint8)
    return np.concatenate([d_bytes, q[:, :16] | (q[:, 16:] << 4)], axis=1)


def rewrite(source, target, kind_of) -> None:
    """The GGUF file `source` written again to `target` with its metadata and each tensor of
    two or more dimensions quantized to kind_of(name, index of its layer or None) (None: as
    it is stored)."""
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(target, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        layer = int(parts[1]) if parts[0] == "blk" else None
        kind = kind_of(tensor.name, layer) if len(tensor.shape) > 1 else None
        if kind is None:
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
            continue
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        writer.add_tensor(tensor.name, quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def q4_k_m_types(n_layers: int):
    """The types llama.cpp's Q4_K_M gives a Llama's tensors (llama-quant.cpp), for a model whose
    rows of `hidden` values are not whole super-blocks: the K-quant of a 576-wide row falls back
    to Q5_0 (Q4_K) or Q8_0 (Q6_K). attn_v and ffn_down take Q6_K in the first and last eighth
    of the layers and every third between."""

    def more_bits(layer: int) -> bool:
        return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2

    def kind_of(name: str, layer: int | None) -> gguf.GGMLQuantizationType:
        kinds = gguf.GGMLQuantizationType
        more = layer is None or (".attn_v." in name or ".ffn_down." in name) and more_bits(layer)
        if ".ffn_down." in name:                      # rows of the intermediate size: whole blocks
            return kinds.Q6_K if more else kinds.Q4_K
        return kinds.Q8_0 if more else kinds.Q5_0

    return kind_of
