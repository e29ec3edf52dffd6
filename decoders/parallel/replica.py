"""What one replica of a tensor-parallel program does with its part of a value: pick its own
block, trade blocks of one axis for blocks of another, write the cache slots it holds.

Replica r of `tp` holds block r wherever a value is split; every helper here is written
for the whole group of `tp` replicas, [[0, 1, ..., tp - 1]].
"""
from __future__ import annotations

from pyhlo.ops import elementwise as ew
from pyhlo.ops.collectives import all_gather, replica_id
from pyhlo.ops.shape_ops import broadcast, dynamic_slice, iota, pad
from pyhlo.scribe import HloValue, Scribe


def group(tp: int) -> list[list[int]]:
    return [list(range(tp))]


def rank(scribe: Scribe) -> HloValue:
    """This replica's number as s32."""
    return ew.convert(replica_id(scribe), "s32")


def block_start(scribe: Scribe, size: int) -> HloValue:
    """s32: where this replica's block starts when each replica holds `size` of something
    (rows of the vocabulary, cache slots): rank * size."""
    return ew.multiply(rank(scribe), size)


def own_block(x: HloValue, dim: int, size: int) -> HloValue:
    """Block `rank` of `size` along `dim`: x[..., rank * size : (rank + 1) * size, ...]."""
    starts: list = [0] * len(x.dims)
    starts[dim] = block_start(x.scribe, size)
    sizes = list(x.dims)
    sizes[dim] = size
    return dynamic_slice(x, starts, sizes)


def exchange(x: HloValue, gather_dim: int, keep_dim: int, tp: int) -> HloValue:
    """An all-to-all: x is this replica's block of `gather_dim`; the result is every replica's
    block of `gather_dim` put together, for this replica's block of `keep_dim`. Written as an
    all-gather and a slice, which every PJRT backend runs."""
    return own_block(all_gather(x, gather_dim, group(tp)), keep_dim, x.dims[keep_dim] // tp)


def write_stretch(cache: HloValue, new: HloValue, slot: HloValue, first: HloValue) -> HloValue:
    """The cache [b, heads, L, d] of slots first .. first + L - 1 with new [b, heads, n, d]
    (the values of slots slot .. slot + n - 1) written where the two overlap."""
    b, heads, length, d = cache.dims
    n = new.dims[2]
    # new laid between L zeros on each side, read from where slot `first` falls: a window
    # that misses the new values entirely is clamped into the zeros, and masked anyway.
    padded = pad(new, 0.0, [0, 0, length, 0], [0, 0, length, 0])
    start = ew.add(ew.subtract(first, slot), length)
    window = dynamic_slice(padded, [0, 0, start, 0], [b, heads, length, d])
    offsets = ew.add(iota(cache.scribe, "s32", (length,), 0),
                     ew.broadcast_scalar(ew.subtract(first, slot), (length,)))
    inside = cache.scribe.pred[length].And(ew.compare(offsets, 0, "GE"), ew.compare(offsets, n, "LT"))
    return ew.select(broadcast(inside, cache.dims, [2]), window, cache)
