"""Scaled dot-product attention over a KV cache, with grouped-query heads, masks and biases."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from pyhlo import dtypes
from pyhlo.ops.collectives import all_gather, all_reduce_sum
from pyhlo.ops.custom_call import ffi_call
from pyhlo.ops.elementwise import add, constant, convert, divide, exp, maximum, multiply, select, subtract
from pyhlo.ops.linalg import dot_general
from pyhlo.ops.nn import soft_cap, softmax
from pyhlo.ops.reductions import reduce_max, reduce_sum
from pyhlo.ops.shape_ops import broadcast, iota, reshape
from pyhlo.scribe import HloValue
from pyhlo.shape_inference import HloShapeError


def lowest(dtype: str) -> float:
    """The most negative finite value of a float type: a mask fill that cannot make NaN."""
    return float(np.finfo(dtypes.numpy_dtype(dtype)).min)


def attention(q: HloValue, k: HloValue, v: HloValue, mask: HloValue | None, scale: float,
              bias: HloValue | None = None, softcap: float | None = None) -> HloValue:
    """softmax(scale * q k^T + bias, masked) v, per batch line and head; with `softcap`
    the scaled scores are soft-capped first, cap * tanh(scores / cap) (Gemma 2).

    q [b, h, nq, d]; k, v [b, kvh, s, d] with h a multiple of kvh: query head j
    reads kv head j // (h // kvh), as HF's repeat_kv. mask pred [b, nq, s] (true =
    attend) or None; bias f32 [h, s] (ALiBi) or [b, h, nq, s]. Returns q's shape and type.
    """
    _check(q, k, v)
    scores = _scores(q, k, mask, scale, bias, softcap)
    probs = convert(softmax(scores, -1), v.dtype)
    return convert(_weighted_values(probs, v), q.dtype)


def _check(q: HloValue, k: HloValue, v: HloValue) -> None:
    b, h, nq, d = q.dims
    kb, kvh, s, kd = k.dims
    if (kb, kd) != (b, d) or v.dims != k.dims:
        raise ValueError(f"attention: q {q.shape!r}, k {k.shape!r}, v {v.shape!r} do not fit [b, h, nq, d] "
                         "and [b, kvh, s, d]")
    if h % kvh:
        raise ValueError(f"attention: {h} query heads are not a multiple of {kvh} kv heads")


def _scores(q: HloValue, k: HloValue, mask: HloValue | None, scale: float, bias: HloValue | None,
            softcap: float | None = None) -> HloValue:
    """f32 [b, h, nq, s]: scale * q k^T (soft-capped) + bias, masked keys at the lowest f32.

    The g = h // kvh query heads sharing a kv head are folded into the query axis
    ([b, kvh, g * nq, d]), so one batched dot over (b, kvh) reads the cache as laid out,
    with no repeat and no transpose of k or v.
    """
    b, h, nq, d = q.dims
    _, kvh, s, _ = k.dims
    g = h // kvh
    scribe = q.scribe
    grouped = reshape(q, (b, kvh, g * nq, d))
    scores = dot_general(grouped, k, ([3], [3]), ([0, 1], [0, 1]), out_dtype="f32")
    scores = multiply(reshape(scores, (b, h, nq, s)), float(scale))
    if softcap is not None:
        scores = soft_cap(scores, softcap)
    if bias is not None:
        bias = convert(bias, "f32")
        if bias.dims == (h, s):
            bias = broadcast(bias, scores.dims, [1, 3])
        elif bias.dims != scores.dims:
            raise ValueError(f"attention: bias {bias.shape!r} must be [h, s] or [b, h, nq, s]")
        scores = add(scores, bias)
    if mask is not None:
        if mask.dims != (b, nq, s) or mask.dtype != "pred":
            raise ValueError(f"attention: mask {mask.shape!r} must be pred[{b},{nq},{s}]")
        visible = broadcast(mask, scores.dims, [0, 2, 3])
        scores = select(visible, scores, constant(scribe, "f32", lowest("f32")))
    return scores


def _weighted_values(probs: HloValue, v: HloValue) -> HloValue:
    """f32 [b, h, nq, d]: probs [b, h, nq, s] times v [b, kvh, s, d], query heads grouped."""
    b, h, nq, s = probs.dims
    kvh, d = v.dims[1], v.dims[3]
    out = dot_general(reshape(probs, (b, kvh, h // kvh * nq, s)), v, ([3], [2]), ([0, 1], [0, 1]),
                      out_dtype="f32")
    return reshape(out, (b, h, nq, d))


def partial_attention(q: HloValue, k: HloValue, v: HloValue, mask: HloValue, scale: float,
                      bias: HloValue | None = None,
                      softcap: float | None = None) -> tuple[HloValue, HloValue, HloValue]:
    """attention() over one part of the keys, left unnormalised so that parts held apart
    (flash decoding: the cache split along the sequence) combine exactly.

    Returns f32 (out [b, h, nq, d], top [b, h, nq], total [b, h, nq]): top = the largest
    visible score, p_j = exp(score_j - top) for visible keys and 0 for masked ones,
    total = sum p_j, out = sum p_j v_j. A query that sees no key of this part gets out 0,
    total 0 and top the lowest f32, so it weighs nothing when the parts are combined:
    softmax over all parts = sum_r out_r e^(top_r - T) / sum_r total_r e^(top_r - T), T = max_r top_r.
    """
    _check(q, k, v)
    scores = _scores(q, k, mask, scale, bias, softcap)
    dims = scores.dims
    top = reduce_max(scores, 3)
    weights = exp(subtract(scores, broadcast(top, dims, [0, 1, 2])))
    weights = select(broadcast(mask, dims, [0, 2, 3]), weights, constant(q.scribe, "f32", 0.0))
    total = reduce_sum(weights, 3)
    return _weighted_values(convert(weights, v.dtype), v), top, total


def combine_attention_parts(out: HloValue, top: HloValue, total: HloValue,
                            replica_groups: Sequence[Sequence[int]]) -> HloValue:
    """Attention over keys split among the replicas of each group, from each replica's
    partial_attention(): f32 [b, h, nq, d], the same on every replica of a group (0 for a
    query that sees no key at all)."""
    everyone = all_gather(reshape(top, (*top.dims, 1)), 3, replica_groups)
    highest = reduce_max(everyone, 3)
    factor = exp(subtract(top, highest))
    out = all_reduce_sum(multiply(out, broadcast(factor, out.dims, [0, 1, 2])), replica_groups)
    total = all_reduce_sum(multiply(total, factor), replica_groups)
    # A query that sees any key has total >= 1 (the part holding the largest score gives its
    # own key weight 1); one that sees none (a left-padding position) gets 0, not 0 / 0.
    total = maximum(total, 1.0)
    return divide(out, broadcast(total, out.dims, [0, 1, 2]))


def _cache_operands(kernel: str, queries: str, q: HloValue, k: HloValue, v: HloValue, slot: HloValue,
                    pad: HloValue, lines: HloValue | None) -> HloValue:
    """The attention kernels' operands checked (q f32[b, h, `queries`, d] with "n" any number;
    caches and rows as decode_attention_kernel takes them); each row's cache line, iota where
    `lines` is None and the caches have one line a row."""
    b, h, nq, d = q.dims
    row = d + 4 if k.dtype == "s8" else d
    if lines is None and len(k.dims) == 4 and k.dims[0] == b:
        lines = iota(q.scribe, "s32", (b,), 0)
    if (q.dtype != "f32" or (queries != "n" and nq != int(queries)) or len(k.dims) != 4 or k.dims[3] != row
            or h % k.dims[1] or v.dims != k.dims or v.dtype != k.dtype
            or k.dtype not in ("f32", "bf16", "u16", "s8")
            or slot.dtype != "s32" or slot.dims != (b,) or pad.dtype != "s32" or pad.dims != (b,)
            or lines is None or lines.dtype != "s32" or lines.dims != (b,)):
        raise HloShapeError(
            f"{kernel}: need f32 q[b, h, {queries}, d], f32/bf16/u16 k and v [B, kvh, S, d] "
            f"(or packed s8 rows [B, kvh, S, d + 4]), s32 slot[b], pad[b] and lines[b] (or B = b); "
            f"got q {q.dtype}{list(q.dims)}, k {k.dtype}{list(k.dims)}, v {v.dtype}{list(v.dims)}, "
            f"slot {slot.dtype}{list(slot.dims)}, pad {pad.dtype}{list(pad.dims)}, "
            f"lines {None if lines is None else (lines.dtype, list(lines.dims))}")
    return lines


def decode_attention_kernel(q: HloValue, k: HloValue, v: HloValue, slot: HloValue, pad: HloValue,
                            scale: float, lines: HloValue | None = None) -> HloValue:
    """One query token per row over the cache slots pad[i] <= t <= slot[i] of its cache line,
    by a CPU kernel called through XLA's typed FFI; the same result as attention() with that
    mask over each row's line.

    q f32[b, h, 1, d]; k, v f32 or bf16 [B, kvh, S, d] (bf16 also as its bits, u16), or packed
    int8 rows s8[B, kvh, S, d + 4] (pyhlo.ops.quantized.quantize_rows); slot s32[b], each
    row's newest slot; pad s32[b]; lines s32[b], each row's cache line (None: row i reads line
    i, B = b). Returns f32[b, h, 1, d].
    The kernel reads the cache in place: no slice of it is copied. It must be registered
    with the backend (runtime.cpu_kernels.register()) before compiling.
    """
    lines = _cache_operands("decode_attention_kernel", "1", q, k, v, slot, pad, lines)
    factor = constant(q.scribe, "f32", float(scale))
    return ffi_call(q.shape, [q, k, v, slot, pad, factor, lines], "pyhlo_decode_attention")


def prefill_attention_kernel(q: HloValue, k: HloValue, v: HloValue, slot: HloValue, pad: HloValue,
                             scale: float, lines: HloValue | None = None,
                             window: int | None = None) -> HloValue:
    """n new tokens per row over its cache line, causally, by a CPU kernel called through XLA's
    typed FFI; the same result as attention() with the causal, padding and window masks: query j
    of row i, at slot slot[i] + j, sees the slots pad[i] <= t <= slot[i] + j (and, with a window,
    slot[i] + j - t < window). A query that sees no slot gets zeros.

    q f32[b, h, n, d]; k, v as decode_attention_kernel takes them, [B, kvh, S, d] (packed s8
    rows [B, kvh, S, d + 4]); slot s32[b], each row's first new slot; pad s32[b]; lines s32[b]
    (None: row i reads line i, B = b). Returns f32[b, h, n, d]. The kernel reads only the slots
    some query sees and skips the rest. It must be registered with the backend
    (runtime.cpu_kernels.register()) before compiling.
    """
    if window is not None and window < 1:
        raise HloShapeError(f"prefill_attention_kernel: a window of at least 1 slot or None; got {window}")
    lines = _cache_operands("prefill_attention_kernel", "n", q, k, v, slot, pad, lines)
    factor = constant(q.scribe, "f32", float(scale))
    span = constant(q.scribe, "s32", int(window or 0))
    return ffi_call(q.shape, [q, k, v, slot, pad, factor, lines, span], "pyhlo_prefill_attention")
