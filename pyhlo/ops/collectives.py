"""Cross-replica collectives for tensor parallelism.

`replica_groups` lists the replicas that talk to each other, e.g. [[0, 1, 2, 3]]
or [[0, 1], [2, 3]]; every group has the same size.
"""
from __future__ import annotations

from typing import Sequence

from pyhlo.ops.reductions import scalar_computation
from pyhlo.scribe import HloValue, Scribe


def _groups(replica_groups: Sequence[Sequence[int]]) -> list[list[int]]:
    groups = [list(map(int, g)) for g in replica_groups]
    if not groups or not groups[0] or any(len(g) != len(groups[0]) for g in groups):
        raise ValueError(f"replica_groups must be non-empty groups of equal size, got {replica_groups}")
    return groups


def all_reduce_sum(x: HloValue, replica_groups: Sequence[Sequence[int]]) -> HloValue:
    """The sum of x over the replicas of each group, on every replica of the group."""
    return x.shape.AllReduce(x, replica_groups=_groups(replica_groups),
                             to_apply=scalar_computation(x.dtype, "Add"))


def all_gather(x: HloValue, dim: int, replica_groups: Sequence[Sequence[int]]) -> HloValue:
    """The group's x concatenated along `dim` in replica-group order (dim grows by the group size)."""
    groups = _groups(replica_groups)
    dim %= len(x.dims)
    dims = list(x.dims)
    dims[dim] *= len(groups[0])
    return getattr(x.scribe, x.dtype)[dims].AllGather(x, dimensions=[dim], replica_groups=groups)


def replica_id(scribe: Scribe) -> HloValue:
    """This replica's number (u32 scalar)."""
    return scribe.u32[()].ReplicaId()
