"""How tensor parallelism shares out keys and values: one decision per model.

NeuronConfig.group_query_attention (a GQA, transformers-neuronx's names) and
NeuronConfig.shard_over_sequence say what the user asks; decide() turns them, with the
model's head counts and tp_degree, into a `KVSharding`, or a ValueError that names the
strategies that fit. From there on the decision travels under that one name: the weights
(sharding.py: which rows of the K and V projections a device holds), the attention piece
(which writes the program for it, blocks/attention.py) and the Session (whether a line's
cache lies whole on a replica). device_heads() says what it gives each device.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from decoders.config import GQA


class KVSharding(enum.Enum):
    """What each of tp_degree devices holds of the keys and values."""

    # Its KV heads, for every line and slot, each with its query heads: whole KV heads split,
    # replicated when fewer than the devices, or padded with zero heads (GQA None,
    # REPLICATED_HEADS, SHARD_OVER_HEADS).
    HEADS = "heads"
    # Every KV head, for its batch lines; query heads and attention outputs change hands
    # (GQA.SHARD_OVER_BATCH).
    BATCH = "batch"
    # K and V projected by features, gathered, then the KV heads of its query heads
    # (GQA.ALL_GATHER_HEADS).
    GATHER = "gather"
    # Every KV head, for its stretch of cache slots (flash decoding: shard_over_sequence).
    SEQUENCE = "sequence"

    @property
    def projections(self) -> str:
        """How the K and V projection weights split: "heads" (whole heads, as above),
        "replicated" (every device all of them) or "features" (evenly by features). The name
        presharded weights are saved under (their manifest's kv_split)."""
        if self in (KVSharding.BATCH, KVSharding.SEQUENCE):
            return "replicated"
        return "features" if self is KVSharding.GATHER else "heads"

    @property
    def whole_lines(self) -> bool:
        """Each replica holds every slot of every line's cache (not split by line or slot)."""
        return self in (KVSharding.HEADS, KVSharding.GATHER)

    @property
    def asked_as(self) -> str:
        """The user's name for this sharding, for error messages."""
        return {KVSharding.BATCH: "GQA.SHARD_OVER_BATCH", KVSharding.GATHER: "GQA.ALL_GATHER_HEADS",
                KVSharding.SEQUENCE: "shard_over_sequence"}.get(self, "GQA.REPLICATED_HEADS")


class HeadCounts(Protocol):
    """The whole model's attention heads (an Attention piece, say)."""

    n_heads: int
    n_kv_heads: int


@dataclass(frozen=True)
class DeviceHeads:
    """One device's attention heads: the query heads it projects and the KV heads it caches."""

    n_heads: int
    n_kv_heads: int


class _Unfit(Exception):
    """A sharding that does not fit the model (the message says why)."""


def padded_groups(groups: int, tp_degree: int) -> int:
    """KV-head groups as `tp_degree` devices hold them: as many as there are where the groups
    split over the devices or the devices over the groups, else padded up to a multiple of
    tp_degree (3 KV heads over 2 or 4 devices: 4)."""
    if groups % tp_degree == 0 or tp_degree % groups == 0:
        return groups
    return -(-groups // tp_degree) * tp_degree


def asked(strategy: GQA | None, over_sequence: bool) -> KVSharding:
    """The sharding the user's settings name, before any check against the model."""
    if over_sequence:
        return KVSharding.SEQUENCE
    return {GQA.SHARD_OVER_BATCH: KVSharding.BATCH, GQA.ALL_GATHER_HEADS: KVSharding.GATHER}.get(
        strategy, KVSharding.HEADS)


def decide(heads: HeadCounts, tp_degree: int, strategy: GQA | None = None,
           over_sequence: bool = False) -> KVSharding:
    """How `tp_degree` devices share out the keys and values of a model with `heads`, by
    NeuronConfig.group_query_attention (`strategy`) and shard_over_sequence:

    - None, GQA.REPLICATED_HEADS: HEADS, the KV heads split, or replicated when fewer than the
      devices, or padded with zero heads (their query heads with them) up to a multiple of
      the devices; each device the query heads of its KV heads;
    - GQA.SHARD_OVER_HEADS: HEADS, insisting on an even split of the KV heads;
    - GQA.SHARD_OVER_BATCH: BATCH, query heads split evenly, every KV head for the device's
      batch lines;
    - GQA.ALL_GATHER_HEADS: GATHER, query heads split evenly, K and V by features, gathered;
    - over_sequence (flash decoding): SEQUENCE, query heads split evenly, every KV head for
      the device's stretch of cache slots.

    One device holds everything whatever is asked. A strategy that does not fit is a
    ValueError naming the ones that do."""
    kv_sharding = asked(strategy, over_sequence)
    if tp_degree == 1:
        return kv_sharding
    n_heads, n_kv_heads, tp = heads.n_heads, heads.n_kv_heads, tp_degree
    try:
        if over_sequence and strategy not in (None, GQA.REPLICATED_HEADS):
            raise _Unfit(f"NeuronConfig.shard_over_sequence splits the caches by slot and cannot be combined "
                         f"with GQA.{strategy.name}; leave group_query_attention None")
        if strategy is GQA.SHARD_OVER_HEADS and n_kv_heads % tp:
            raise _Unfit(f"GQA.SHARD_OVER_HEADS splits the {n_kv_heads} KV heads over the devices, and "
                         f"tp_degree {tp} does not divide them (use a tp_degree that divides {n_kv_heads})")
        _device_heads(n_heads, n_kv_heads, tp, kv_sharding)
    except _Unfit as unfit:
        raise ValueError(f"{unfit}; {_working(n_heads, n_kv_heads, tp)}") from None
    return kv_sharding


def device_heads(heads: HeadCounts, tp_degree: int, kv_sharding: KVSharding) -> DeviceHeads:
    """The heads one of `tp_degree` devices holds under `kv_sharding` (a ValueError naming the
    strategies that fit where it does not)."""
    try:
        return _device_heads(heads.n_heads, heads.n_kv_heads, tp_degree, kv_sharding)
    except _Unfit as unfit:
        raise ValueError(f"{unfit}; {_working(heads.n_heads, heads.n_kv_heads, tp_degree)}") from None


def _device_heads(n_heads: int, n_kv_heads: int, tp: int, kv_sharding: KVSharding) -> DeviceHeads:
    if kv_sharding is not KVSharding.HEADS:
        if n_heads % tp:
            raise _Unfit(f"{kv_sharding.asked_as} splits the {n_heads} query heads evenly, and tp_degree "
                         f"{tp} does not divide them")
        heads = n_heads // tp
        if kv_sharding is not KVSharding.GATHER:
            return DeviceHeads(heads, n_kv_heads)
        group = n_heads // n_kv_heads
        if heads % group and group % heads:
            raise _Unfit(f"GQA.ALL_GATHER_HEADS gives each device {heads} query heads, which neither hold "
                         f"whole groups of the {group} query heads that share a KV head nor sit inside one")
        return DeviceHeads(heads, max(heads // group, 1))
    groups = padded_groups(n_kv_heads, tp)
    heads = n_heads // n_kv_heads * groups
    if heads % tp:
        raise _Unfit(f"{n_heads} attention heads cannot be split over tp_degree {tp}; use a tp_degree "
                     f"that divides {n_heads}")
    return DeviceHeads(heads // tp, groups // tp if groups % tp == 0 else 1)


def _working(n_heads: int, n_kv_heads: int, tp: int) -> str:
    """What works for this model over `tp` devices, for an error message."""
    works = []
    try:
        device = _device_heads(n_heads, n_kv_heads, tp, KVSharding.HEADS)
        groups = padded_groups(n_kv_heads, tp)
        how = ("split" if n_kv_heads % tp == 0 else "replicated" if groups == n_kv_heads
               else f"padded to {groups}")
        names = (["SHARD_OVER_HEADS"] if n_kv_heads % tp == 0 else []) + ["REPLICATED_HEADS (or None)"]
        works.append(f"{' and '.join(names)} {'work' if len(names) > 1 else 'works'}: {device.n_heads} query "
                     f"and {device.n_kv_heads} KV heads a device, the {n_kv_heads} KV heads {how}")
    except _Unfit:
        pass
    if n_heads % tp == 0:
        heads = n_heads // tp
        works.append(f"SHARD_OVER_BATCH works with a batch size that {tp} divides: {heads} query heads a "
                     f"device, all {n_kv_heads} KV heads cached for its lines")
        try:
            device = _device_heads(n_heads, n_kv_heads, tp, KVSharding.GATHER)
            works.append(f"ALL_GATHER_HEADS works: {heads} query and {device.n_kv_heads} KV heads a device, "
                         "K and V split by features and gathered")
        except _Unfit:
            pass
        works.append(f"shard_over_sequence works with an n_positions that {tp} divides")
    return "; ".join(works) if works else f"no strategy splits {n_heads} query heads over tp_degree {tp}"
