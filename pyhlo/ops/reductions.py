"""Reductions: sum, max, min, argmax, cumulative sum."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from pyhlo.dtypes import FLOAT_TYPES, numpy_dtype
from pyhlo.ops.elementwise import constant
from pyhlo.ops.shape_ops import get_tuple_element, iota, reshape
from pyhlo.scribe import HloValue, Scribe


def lowest_value(dtype: str):
    """The identity of max on `dtype`: -inf for floats, the smallest integer otherwise."""
    if dtype in FLOAT_TYPES:
        return float("-inf")
    if dtype == "pred":
        return False
    return int(np.iinfo(numpy_dtype(dtype)).min)


def highest_value(dtype: str):
    """The identity of min on `dtype`: inf for floats, the largest integer otherwise."""
    if dtype in FLOAT_TYPES:
        return float("inf")
    if dtype == "pred":
        return True
    return int(np.iinfo(numpy_dtype(dtype)).max)


def _binary_computation(dtype: str, op: str):
    def computation(scribe: Scribe) -> HloValue:
        scalar = getattr(scribe, dtype)[()]
        a = scalar.Parameter(parameter_number=0)
        b = scalar.Parameter(parameter_number=1)
        return getattr(scalar, op)(a, b)

    computation.__name__ = f"{op.lower()}_{dtype}"
    return computation


_COMPUTATIONS: dict[tuple[str, str], object] = {}


def scalar_computation(dtype: str, op: str):
    """The sub-computation (a, b) -> op(a, b) on `dtype` scalars, shared by every user."""
    key = (dtype, op)
    if key not in _COMPUTATIONS:
        _COMPUTATIONS[key] = _binary_computation(dtype, op)
    return _COMPUTATIONS[key]


def _normalize(x: HloValue, dims: int | Sequence[int]) -> list[int]:
    dims = [dims] if isinstance(dims, int) else list(dims)
    return sorted(d % len(x.dims) for d in dims)


def _reduce(x: HloValue, dims, op: str, init, keep_dims: bool) -> HloValue:
    dims = _normalize(x, dims)
    out = [d for i, d in enumerate(x.dims) if i not in dims]
    result = getattr(x.scribe, x.dtype)[tuple(out)].Reduce(
        x, constant(x.scribe, x.dtype, init), dimensions=dims,
        to_apply=scalar_computation(x.dtype, op),
    )
    if keep_dims:
        result = reshape(result, [1 if i in dims else d for i, d in enumerate(x.dims)])
    return result


def reduce_sum(x: HloValue, dims: int | Sequence[int], keep_dims: bool = False) -> HloValue:
    return _reduce(x, dims, "Add", 0, keep_dims)


def reduce_max(x: HloValue, dims: int | Sequence[int], keep_dims: bool = False) -> HloValue:
    return _reduce(x, dims, "Maximum", lowest_value(x.dtype), keep_dims)


def reduce_min(x: HloValue, dims: int | Sequence[int], keep_dims: bool = False) -> HloValue:
    return _reduce(x, dims, "Minimum", highest_value(x.dtype), keep_dims)


def _argmax_computation(dtype: str):
    def argmax_pair(scribe: Scribe):
        value = getattr(scribe, dtype)[()]
        index = scribe.s32[()]
        a_val = value.Parameter(parameter_number=0)
        a_idx = index.Parameter(parameter_number=1)
        b_val = value.Parameter(parameter_number=2)
        b_idx = index.Parameter(parameter_number=3)
        a_greater = scribe.pred[()].Compare(a_val, b_val, comparison_direction="GT")
        equal = scribe.pred[()].Compare(a_val, b_val, comparison_direction="EQ")
        a_smaller_index = scribe.pred[()].Compare(a_idx, b_idx, comparison_direction="LT")
        tie_to_a = scribe.pred[()].And(equal, a_smaller_index)
        take_a = scribe.pred[()].Or(a_greater, tie_to_a)
        best_val = value.Select(take_a, a_val, b_val)
        best_idx = index.Select(take_a, a_idx, b_idx)
        return scribe.tuple(value, index).Tuple(best_val, best_idx)

    argmax_pair.__name__ = f"argmax_{dtype}"
    return argmax_pair


def argmax(x: HloValue, dim: int, keep_dims: bool = False) -> HloValue:
    """Index (s32) of the largest element along `dim`; ties go to the smallest index."""
    dim = dim % len(x.dims)
    key = (x.dtype, "argmax")
    if key not in _COMPUTATIONS:
        _COMPUTATIONS[key] = _argmax_computation(x.dtype)
    scribe = x.scribe
    indices = iota(scribe, "s32", x.dims, dim)
    out = tuple(d for i, d in enumerate(x.dims) if i != dim)
    pair = scribe.tuple(getattr(scribe, x.dtype)[out], scribe.s32[out]).Reduce(
        x, indices, constant(scribe, x.dtype, lowest_value(x.dtype)),
        constant(scribe, "s32", 0), dimensions=[dim], to_apply=_COMPUTATIONS[key],
    )
    result = get_tuple_element(pair, 1)
    if keep_dims:
        result = reshape(result, [1 if i == dim else d for i, d in enumerate(x.dims)])
    return result


def cumsum(x: HloValue, dim: int) -> HloValue:
    """Inclusive cumulative sum along `dim` (a reduce-window over a growing prefix)."""
    dim = dim % len(x.dims)
    window = []
    for i, d in enumerate(x.dims):
        if i == dim:
            window.append(dict(size=d, stride=1, padding_low=d - 1, padding_high=0,
                               window_dilation=1, base_dilation=1))
        else:
            window.append(dict(size=1, stride=1, window_dilation=1, base_dilation=1))
    return x.shape.ReduceWindow(
        x, constant(x.scribe, x.dtype, 0), window=dict(dimensions=window),
        to_apply=scalar_computation(x.dtype, "Add"),
    )
