"""How tensor parallelism splits the declared parameters: which part of a weight each device holds.

A `Param` says along which axis it is split (`Shard.COLUMN`: `out`; `ROW`: `in`; `VOCAB`:
rows of the LM head; `REPLICATED`: not at all). A weight fused from parts (q|k|v, gate|up)
is split part by part, each part in whole `unit`s (a head's head_dim features): device r
holds block r of every part. A part with fewer units than devices (2 KV heads over 4
devices) is replicated instead: device r holds unit r // (devices / units), so the query
heads a device holds find their KV head beside them (transformers-neuronx's replicated
KV heads). KV heads that neither split nor replicate evenly (3 over 2 or 4 devices) are
padded with zero heads, group by group, up to a multiple of the devices; a padding head's
zero query, key and value add nothing through its zero output-projection columns. Any other
split that does not divide (a vocabulary of 49153 rows, an MLP 1000 wide, over 4 devices) is
padded the same way with zero rows up to a multiple of the devices: a padding MLP feature's
zero input and output weights add nothing, and the LM head masks its padding logits.

How keys and values are shared out (a `KVSharding`, decided in kv_sharding.py):
- HEADS: as above (GQA None, SHARD_OVER_HEADS, REPLICATED_HEADS);
- BATCH, SEQUENCE: every device holds the whole K and V projections (GQA.SHARD_OVER_BATCH and
  flash decoding, whose caches are split by batch line or by sequence slot instead);
- GATHER: K and V split evenly by features, heads cut across devices (GQA.ALL_GATHER_HEADS,
  which gathers them after the product).
Under the last three, query heads split evenly, never padded in KV groups.
"""
from __future__ import annotations

import numpy as np

from decoders.blocks.params import Kind, Param, Shard
from decoders.parallel.kv_sharding import KVSharding, padded_groups


def split_axis(param: Param) -> int | None:
    """The axis of the logical shape ([out, in] for a linear) that devices split, or None."""
    if param.shard is Shard.REPLICATED:
        return None
    if param.shard is Shard.ROW:
        return 1 if param.kind is Kind.LINEAR else None
    return 0


def indices(param: Param, tp_degree: int, rank: int,
            kv_sharding: KVSharding = KVSharding.HEADS) -> np.ndarray | None:
    """The indices along split_axis(param) that device `rank` of `tp_degree` holds (None: all;
    -1: a row of a padding head, zeros)."""
    projections = KVSharding(kv_sharding).projections
    axis = split_axis(param)
    if axis is None or tp_degree == 1:
        return None
    length = param.shape[axis]
    segments = param.segments if axis == 0 and param.segments else (length,)
    held, start = [], 0
    for index, size in enumerate(segments):
        unit = param.unit
        if projections != "heads" and axis == 0 and index in param.kv_segments:
            if projections == "replicated":
                held.append(start + np.arange(size))
                start += size
                continue
            unit = 1                                                  # "features"
        units = size // unit
        padded = units
        groups = param.head_groups if projections == "heads" else 0
        if groups:
            padded = units // groups * padded_groups(groups, tp_degree)
        if groups and padded % tp_degree and tp_degree % padded == 0:
            per, first = 1, rank // (tp_degree // padded)          # KV heads replicated
        else:
            per = -(-padded // tp_degree)                             # padded up to a multiple
            first = rank * per
        rows = np.arange(first * unit, (first + per) * unit)
        held.append(np.where(rows < size, start + rows, -1))
        start += size
    return np.concatenate(held)


def local_shape(param: Param, tp_degree: int, kv_sharding: KVSharding = KVSharding.HEADS) -> tuple[int, ...]:
    """The shape of one device's part."""
    held = indices(param, tp_degree, 0, kv_sharding)
    if held is None:
        return param.shape
    shape = list(param.shape)
    shape[split_axis(param)] = len(held)
    return tuple(shape)


def shard(param: Param, array: np.ndarray, tp_degree: int, rank: int,
          kv_sharding: KVSharding = KVSharding.HEADS) -> np.ndarray:
    """Device `rank`'s part of a parameter's full (logical) array."""
    held = indices(param, tp_degree, rank, kv_sharding)
    if held is None:
        return array
    axis = split_axis(param)
    part = np.take(array, np.maximum(held, 0), axis=axis)
    if (held < 0).any():
        padding = [slice(None)] * array.ndim
        padding[axis] = held < 0
        part[tuple(padding)] = 0
    return part
