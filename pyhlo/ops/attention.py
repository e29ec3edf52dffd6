"""Scaled dot-product attention over a KV cache, with grouped-query heads, masks and biases."""
from __future__ import annotations

import numpy as np

from pyhlo import dtypes
from pyhlo.ops.elementwise import add, constant, convert, multiply, select
from pyhlo.ops.linalg import dot_general
from pyhlo.ops.nn import softmax
from pyhlo.ops.shape_ops import broadcast, reshape
from pyhlo.scribe import HloValue


def lowest(dtype: str) -> float:
    """The most negative finite value of a float type: a mask fill that cannot make NaN."""
    return float(np.finfo(dtypes.numpy_dtype(dtype)).min)


def attention(q: HloValue, k: HloValue, v: HloValue, mask: HloValue | None, scale: float,
              bias: HloValue | None = None) -> HloValue:
    """softmax(scale * q k^T + bias, masked) v, per batch line and head.

    q [b, h, nq, d]; k, v [b, kvh, s, d] with h a multiple of kvh: query head j
    reads kv head j // (h // kvh), as HF's repeat_kv. mask pred [b, nq, s] (true =
    attend) or None; bias f32 [h, s] (ALiBi) or [b, h, nq, s]. Returns q's shape and type.

    The g = h // kvh query heads sharing a kv head are folded into the query
    axis ([b, kvh, g * nq, d]), so one batched dot over (b, kvh) reads the cache
    as laid out, with no repeat and no transpose of k or v.
    """
    b, h, nq, d = q.dims
    kb, kvh, s, kd = k.dims
    if (kb, kd) != (b, d) or v.dims != k.dims:
        raise ValueError(f"attention: q {q.shape!r}, k {k.shape!r}, v {v.shape!r} do not fit [b, h, nq, d] "
                         "and [b, kvh, s, d]")
    if h % kvh:
        raise ValueError(f"attention: {h} query heads are not a multiple of {kvh} kv heads")
    g = h // kvh
    scribe = q.scribe
    grouped = reshape(q, (b, kvh, g * nq, d))
    scores = dot_general(grouped, k, ([3], [3]), ([0, 1], [0, 1]), out_dtype="f32")
    scores = multiply(reshape(scores, (b, h, nq, s)), float(scale))
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
    probs = convert(softmax(scores, -1), v.dtype)
    out = dot_general(reshape(probs, (b, kvh, g * nq, s)), v, ([3], [2]), ([0, 1], [0, 1]),
                      out_dtype="f32")
    return convert(reshape(out, (b, h, nq, d)), q.dtype)
