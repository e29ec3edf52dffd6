"""Data movement: reshape, transpose, broadcast, slicing, concatenation, padding, iota."""
from __future__ import annotations

from typing import Sequence, Union

from pyhlo.ops.elementwise import constant
from pyhlo.scribe import HloValue, Scribe

Index = Union[HloValue, int]


def _shape(x: HloValue, dims: Sequence[int]):
    return getattr(x.scribe, x.dtype)[tuple(dims)]


def reshape(x: HloValue, dims: Sequence[int]) -> HloValue:
    if tuple(dims) == x.dims:
        return x
    return _shape(x, dims).Reshape(x)


def transpose(x: HloValue, permutation: Sequence[int]) -> HloValue:
    """Output dim i is input dim permutation[i]."""
    if list(permutation) == list(range(len(x.dims))):
        return x
    return _shape(x, [x.dims[p] for p in permutation]).Transpose(x, dimensions=list(permutation))


def broadcast(x: HloValue, dims: Sequence[int], broadcast_dimensions: Sequence[int]) -> HloValue:
    """x placed into `dims`: input dim i becomes output dim broadcast_dimensions[i]."""
    return _shape(x, dims).Broadcast(x, dimensions=list(broadcast_dimensions))


def slice_along(x: HloValue, dim: int, start: int, limit: int, stride: int = 1) -> HloValue:
    """x[..., start:limit:stride, ...] along `dim`."""
    bounds = [dict(start=0, limit=d, stride=1) for d in x.dims]
    bounds[dim] = dict(start=start, limit=limit, stride=stride)
    size = -(-(limit - start) // stride)
    dims = list(x.dims)
    dims[dim] = size
    return _shape(x, dims).Slice(x, slice_dimensions=bounds)


def _indices(scribe: Scribe, starts: Sequence[Index]) -> list[HloValue]:
    return [s if isinstance(s, HloValue) else constant(scribe, "s32", s) for s in starts]


def dynamic_slice(x: HloValue, starts: Sequence[Index], sizes: Sequence[int]) -> HloValue:
    """x[starts[0]:starts[0]+sizes[0], ...], starts clamped into range as XLA does."""
    return _shape(x, sizes).DynamicSlice(
        x, *_indices(x.scribe, starts), dynamic_slice_sizes=list(sizes)
    )


def dynamic_update_slice(x: HloValue, update: HloValue, starts: Sequence[Index]) -> HloValue:
    """x with `update` written at `starts` (clamped so the update fits)."""
    return x.shape.DynamicUpdateSlice(x, update, *_indices(x.scribe, starts))


def concatenate(values: Sequence[HloValue], dim: int) -> HloValue:
    if len(values) == 1:
        return values[0]
    dims = list(values[0].dims)
    dims[dim] = sum(v.dims[dim] for v in values)
    return _shape(values[0], dims).Concatenate(*values, dimensions=[dim])


def pad(x: HloValue, value, low: Sequence[int], high: Sequence[int],
        interior: Sequence[int] | None = None) -> HloValue:
    """Pad each dim with `value`: `low[i]` before, `high[i]` after, `interior[i]` between."""
    interior = interior or [0] * len(x.dims)
    pad_value = value if isinstance(value, HloValue) else constant(x.scribe, x.dtype, value)
    dims = [lo + hi + d + max(d - 1, 0) * it for d, lo, hi, it in zip(x.dims, low, high, interior)]
    config = dict(dimensions=[
        dict(edge_padding_low=lo, edge_padding_high=hi, interior_padding=it)
        for lo, hi, it in zip(low, high, interior)
    ])
    return _shape(x, dims).Pad(x, pad_value, padding_config=config)


def iota(scribe: Scribe, dtype: str, dims: Sequence[int], dim: int) -> HloValue:
    """An array of `dims` whose value is its index along `dim`."""
    return getattr(scribe, dtype)[tuple(dims)].Iota(dimensions=[dim])


def get_tuple_element(t: HloValue, index: int) -> HloValue:
    return t.shape.elements[index].GetTupleElement(t, tuple_index=index)


def make_tuple(*values: HloValue) -> HloValue:
    scribe = values[0].scribe
    return scribe.tuple(*(v.shape for v in values)).Tuple(*values)

