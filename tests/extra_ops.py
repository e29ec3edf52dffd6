"""Ops the library does not use, kept for the tests that check them against their references
(HF's ALiBi and gated MLP, XLA's reduce-scatter on several replicas, amp names)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from pyhlo.dtypes import AMP_TYPES
from pyhlo.ops.collectives import _groups
from pyhlo.ops.elementwise import constant, convert, multiply
from pyhlo.ops.linalg import matmul
from pyhlo.ops.nn import activation_fn
from pyhlo.ops.precision import LOW_PRECISION
from pyhlo.ops.reductions import scalar_computation
from pyhlo.ops.shape_ops import broadcast, iota
from pyhlo.scribe import HloValue, Scribe


def compute_dtype(amp: str) -> str:
    """The element type name for an `amp` setting, any case: 'bf16' and 'BFloat16' both give 'bf16'."""
    name = AMP_TYPES.get(amp.lower()) if isinstance(amp, str) else None
    if name is None:
        raise ValueError(f"unknown amp dtype {amp!r}; valid names: {', '.join(sorted(AMP_TYPES))}")
    return name


def upcast(x: HloValue, dtype: str = "f32") -> HloValue:
    """x widened to `dtype` for accurate math (a no-op when x already is `dtype`)."""
    return convert(x, dtype)


def downcast(x: HloValue, dtype: str) -> HloValue:
    """x rounded to `dtype` (a no-op when x already is `dtype`)."""
    return convert(x, dtype)


def gated_mlp(x: HloValue, gate_w: HloValue, up_w: HloValue, down_w: HloValue,
              activation: str = "silu") -> HloValue:
    """down(act(x @ gate) * (x @ up)); weights [in, out]: gate/up [hidden, inter], down [inter, hidden].

    bf16/f16 products accumulate into f32 (the fast bf16 form on XLA:CPU for [in, out]
    weights), the activation runs in f32, and the result comes back in x's type.
    """
    act = activation_fn(activation)
    acc = "f32" if x.dtype in LOW_PRECISION else x.dtype
    gate = matmul(x, gate_w, out_dtype=acc)
    up = matmul(x, up_w, out_dtype=acc)
    hidden = convert(multiply(act(gate), up), x.dtype)
    return convert(matmul(hidden, down_w, out_dtype=acc), x.dtype)


def alibi_bias(scribe: Scribe, slopes: np.ndarray, n_keys: int) -> HloValue:
    """f32[n_heads, n_keys] = slope[h] * key_index, added to attention scores before softmax."""
    slopes = np.asarray(slopes, dtype=np.float32).reshape(-1)
    dims = (len(slopes), n_keys)
    per_head = broadcast(constant(scribe, "f32", slopes, (len(slopes),)), dims, [0])
    return multiply(per_head, iota(scribe, "f32", dims, 1))


def reduce_scatter(x: HloValue, dim: int, replica_groups: Sequence[Sequence[int]]) -> HloValue:
    """The group's sum of x, split along `dim`: the i-th replica of a group keeps the i-th block."""
    groups = _groups(replica_groups)
    dim %= len(x.dims)
    size = len(groups[0])
    if x.dims[dim] % size:
        raise ValueError(f"reduce_scatter: dim {dim} of {x.shape!r} does not split into {size} parts")
    dims = list(x.dims)
    dims[dim] //= size
    return getattr(x.scribe, x.dtype)[dims].ReduceScatter(
        x, dimensions=[dim], replica_groups=groups, to_apply=scalar_computation(x.dtype, "Add")
    )
