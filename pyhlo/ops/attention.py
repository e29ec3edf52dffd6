"""Scaled dot-product attention over a KV cache, with grouped-query heads, masks and biases."""
from __future__ import annotations

import numpy as np

from pyhlo import dtypes
from pyhlo.ops.custom_call import ffi_call
from pyhlo.ops.elementwise import add, constant, convert, multiply, select
from pyhlo.ops.linalg import dot_general
from pyhlo.ops.nn import softmax
from pyhlo.ops.shape_ops import broadcast, reshape
from pyhlo.scribe import HloValue
from pyhlo.shape_inference import HloShapeError


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


def decode_attention_kernel(q: HloValue, k: HloValue, v: HloValue, slot: HloValue, pad: HloValue,
                            scale: float, target: str = "pyhlo_decode_attention") -> HloValue:
    """One query token per line over the cache slots pad[i] <= t <= slot, by a CPU kernel
    called through XLA's typed FFI; the same result as attention() with that mask.

    q f32[b, h, 1, d]; k, v f32 or bf16 [b, kvh, S, d]; slot s32[]; pad s32[b]. Returns
    f32[b, h, 1, d]. The kernel reads the cache in place: no slice of it is copied. It must
    be registered with the backend (runtime.cpu_kernels.register()) before compiling.
    """
    b, h, nq, d = q.dims
    if (q.dtype != "f32" or nq != 1 or len(k.dims) != 4 or k.dims[0] != b or k.dims[3] != d
            or h % k.dims[1] or v.dims != k.dims or v.dtype != k.dtype or k.dtype not in ("f32", "bf16")
            or slot.dtype != "s32" or slot.dims != () or pad.dtype != "s32" or pad.dims != (b,)):
        raise HloShapeError(
            f"decode_attention_kernel: need f32 q[b, h, 1, d], f32/bf16 k and v [b, kvh, S, d], s32 slot[] "
            f"and pad[b]; got q {q.dtype}{list(q.dims)}, k {k.dtype}{list(k.dims)}, v {v.dtype}{list(v.dims)}, "
            f"slot {slot.dtype}{list(slot.dims)}, pad {pad.dtype}{list(pad.dims)}")
    factor = constant(q.scribe, "f32", float(scale))
    return ffi_call(q.shape, [q, k, v, slot, pad, factor], target)
