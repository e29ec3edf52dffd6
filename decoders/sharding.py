"""Tensor parallelism over declared parameters: which part of a weight each device holds.

A `Param` says along which axis it is split (`Shard.COLUMN`: `out`; `ROW`: `in`; `VOCAB`:
rows of the LM head; `REPLICATED`: not at all). A weight fused from parts (q|k|v, gate|up)
is split part by part, each part in whole `unit`s (a head's head_dim features): device r
holds block r of every part. A part with fewer units than devices (2 KV heads over 4
devices) is replicated instead: device r holds unit r // (devices / units), so the query
heads a device holds find their KV head beside them (transformers-neuronx's replicated
KV heads). KV heads that neither split nor replicate evenly (3 over 2 or 4 devices) are
padded with zero heads, group by group, up to a multiple of the devices; a padding head's
zero query, key and value add nothing through its zero output-projection columns.
"""
from __future__ import annotations

import numpy as np

from decoders.blocks.params import Kind, Param, Shard, padded_groups


def split_axis(param: Param) -> int | None:
    """The axis of the logical shape ([out, in] for a linear) that devices split, or None."""
    if param.shard is Shard.REPLICATED:
        return None
    if param.shard is Shard.ROW:
        return 1 if param.kind is Kind.LINEAR else None
    return 0


def indices(param: Param, tp_degree: int, rank: int) -> np.ndarray | None:
    """The indices along split_axis(param) that device `rank` of `tp_degree` holds (None: all;
    -1: a row of a padding head, zeros)."""
    axis = split_axis(param)
    if axis is None or tp_degree == 1:
        return None
    length = param.shape[axis]
    segments = param.segments if axis == 0 and param.segments else (length,)
    held, start = [], 0
    for size in segments:
        units = size // param.unit
        padded = units
        if param.head_groups:
            padded = units // param.head_groups * padded_groups(param.head_groups, tp_degree)
        if padded % tp_degree == 0:
            per, first = padded // tp_degree, rank * (padded // tp_degree)
        elif tp_degree % padded == 0:
            per, first = 1, rank // (tp_degree // padded)
        else:
            raise ValueError(
                f"{param.name}: {units} {'heads' if param.unit > 1 else 'rows'} of a part cannot be split over "
                f"tp_degree {tp_degree}; use a tp_degree that divides {units} or that {units} divides")
        rows = np.arange(first * param.unit, (first + per) * param.unit)
        held.append(np.where(rows < size, start + rows, -1))
        start += size
    return np.concatenate(held)


def local_shape(param: Param, tp_degree: int) -> tuple[int, ...]:
    """The shape of one device's part."""
    held = indices(param, tp_degree, 0)
    if held is None:
        return param.shape
    shape = list(param.shape)
    shape[split_axis(param)] = len(held)
    return tuple(shape)


def shard(param: Param, array: np.ndarray, tp_degree: int, rank: int) -> np.ndarray:
    """Device `rank`'s part of a parameter's full (logical) array."""
    held = indices(param, tp_degree, rank)
    if held is None:
        return array
    axis = split_axis(param)
    part = np.take(array, np.maximum(held, 0), axis=axis)
    if (held < 0).any():
        padding = [slice(None)] * array.ndim
        padding[axis] = held < 0
        part[tuple(padding)] = 0
    return part
