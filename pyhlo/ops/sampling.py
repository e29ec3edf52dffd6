"""Token selection on the device: greedy, and top-k / top-p / temperature sampling.

Sampling follows HF's warpers in HF's order: temperature, then TopKLogitsWarper
(keep logits >= the k-th largest), then TopPLogitsWarper (drop a token when the
probability of the tokens ranked above it already reaches top_p), then one draw
from the renormalized distribution. The random state is an explicit u32[2, 2]
input and output of the program, so a generation is reproducible from its seed.

Under tensor parallelism each replica holds a block of the vocabulary's logits:
`greedy_sharded` and `sample_sharded` gather each replica's best candidates (never
the logits) and pick from them, the same token on every replica.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from pyhlo.ops.collectives import all_gather
from pyhlo.ops.elementwise import (
    add,
    bitcast_convert,
    compare,
    constant,
    convert,
    divide,
    exp,
    full_like,
    minimum,
    multiply,
    select,
    subtract,
)
from pyhlo.ops.nn import expand
from pyhlo.ops.reductions import argmax, cumsum, highest_value, reduce_max, reduce_min, reduce_sum
from pyhlo.ops.shape_ops import concatenate, get_tuple_element, iota, reshape, slice_along
from pyhlo.scribe import HloValue

RNG_ALGORITHM = "RNG_THREE_FRY"


def seed_state(seed: int) -> np.ndarray:
    """A u32[2, 2] random state for `rng_uniform` from an integer seed (host side)."""
    words = np.random.SeedSequence(seed).generate_state(4, dtype=np.uint32)
    return words.reshape(2, 2)


def uniform_from_bits(bits: HloValue) -> HloValue:
    """u32 random bits -> f32 uniforms in [0, 1).

    The top 23 bits become the mantissa of a float in [1, 2); subtracting 1 leaves
    an exact multiple of 2^-23, so 1.0 can never come out.
    """
    shape = bits.shape
    mantissa = shape.ShiftRightLogical(bits, full_like(bits, 9))
    one_to_two = bitcast_convert(shape.Or(mantissa, full_like(bits, 0x3F800000)), "f32")
    return subtract(one_to_two, 1.0)


def rng_uniform(state: HloValue, dims: Sequence[int]) -> tuple[HloValue, HloValue]:
    """(f32 uniforms in [0, 1) of `dims`, the next state), from a u32[2, 2] state.

    rng-bit-generator keeps its state as u64[2]; programs pass it as u32[2, 2]
    (64-bit arrays are narrowed on their way to the device unless x64 is on), so
    it is bitcast on the way in and out.
    """
    if state.dims != (2, 2) or state.dtype != "u32":
        raise ValueError(f"rng_uniform: state must be u32[2,2], got {state.shape!r}")
    scribe = state.scribe
    dims = tuple(dims)
    state64 = scribe.u64[2].BitcastConvert(state)
    pair = scribe.tuple(scribe.u64[2], scribe.u32[dims]).RngBitGenerator(
        state64, rng_algorithm=RNG_ALGORITHM
    )
    new_state = scribe.u32[2, 2].BitcastConvert(get_tuple_element(pair, 0))
    return uniform_from_bits(get_tuple_element(pair, 1)), new_state


def greedy(logits: HloValue) -> HloValue:
    """s32[b]: the index of the largest logit per line, ties to the smallest index."""
    return argmax(logits, -1)


def top_k(logits: HloValue, k: int) -> tuple[HloValue, HloValue]:
    """(values, s32 indices) of the k largest logits along the last dim, largest first."""
    scribe = logits.scribe
    dims = logits.dims[:-1] + (k,)
    pair = scribe.tuple(getattr(scribe, logits.dtype)[dims], scribe.s32[dims]).TopK(
        logits, k=k, largest=True
    )
    return get_tuple_element(pair, 0), get_tuple_element(pair, 1)


def _pick(values: HloValue, rank: HloValue, chosen: HloValue) -> HloValue:
    """values[b, chosen[b]] for a [b, k] array (a one-hot select and a sum)."""
    hit = compare(rank, expand(chosen, rank.dims, 1), "EQ")
    return reduce_sum(select(hit, values, constant(values.scribe, values.dtype, 0)), 1)


def top_k_top_p_probs(logits: HloValue, k_per_line: HloValue, top_p: HloValue, temperature: HloValue,
                      k_max: int) -> tuple[HloValue, HloValue]:
    """(probabilities f32[b, k_max] by rank, token ids s32[b, k_max]) after HF's warpers.

    Filtered-out ranks have probability 0; the kept ranks form a prefix and sum to 1.
    """
    b, vocab = logits.dims
    if not 1 <= k_max <= vocab:
        raise ValueError(f"sample: k_max={k_max} must be in 1..{vocab}")
    scribe = logits.scribe
    logits = convert(logits, "f32")
    scaled = divide(logits, expand(convert(temperature, "f32"), logits.dims, 1))
    values, ids = top_k(scaled, k_max)
    dims = values.dims
    rank = iota(scribe, "s32", dims, 1)
    # TopKLogitsWarper keeps every logit >= the k-th largest (ties at the boundary stay).
    k = scribe.s32[b].Clamp(constant(scribe, "s32", 1), convert(k_per_line, "s32"),
                            constant(scribe, "s32", k_max))
    kth_value = _pick(values, rank, subtract(k, 1))
    keep = compare(values, expand(kth_value, dims, 1), "GE")
    zero = constant(scribe, "f32", 0.0)
    weights = select(keep, exp(subtract(values, expand(reduce_max(values, 1), dims, 1))), zero)
    probs = divide(weights, expand(reduce_sum(weights, 1), dims, 1))
    # TopPLogitsWarper drops a token once the tokens ranked above it hold >= top_p of the mass.
    mass_above = subtract(cumsum(probs, 1), probs)
    keep_p = compare(mass_above, expand(convert(top_p, "f32"), dims, 1), "LT")
    first = compare(rank, 0, "EQ")
    keep_p = scribe.pred[dims].Or(keep_p, first)
    weights = select(keep_p, probs, zero)
    return divide(weights, expand(reduce_sum(weights, 1), dims, 1)), ids


def sample(logits: HloValue, top_k: HloValue, top_p: HloValue, temperature: HloValue,
           state: HloValue, k_max: int) -> tuple[HloValue, HloValue]:
    """(tokens s32[b], new state): one draw per line from HF's top-k/top-p filtered softmax.

    logits f32[b, V]; top_k s32[b] in 1..k_max; top_p f32[b] in (0, 1];
    temperature f32[b] > 0; state u32[2, 2]; k_max a static bound on top_k
    (k_max == V sorts the whole vocabulary).
    """
    probs, ids = top_k_top_p_probs(logits, top_k, top_p, temperature, k_max)
    scribe = logits.scribe
    b = logits.dims[0]
    dims = probs.dims
    uniform, new_state = rng_uniform(state, (b,))
    # Inverse CDF: the chosen rank is the number of ranks whose cumulative mass is <= u * total.
    cdf = cumsum(probs, 1)
    total = slice_along(cdf, 1, k_max - 1, k_max)
    target = multiply(uniform, scribe.f32[b].Reshape(total))
    below = compare(cdf, expand(target, dims, 1), "LE")
    one, none = constant(scribe, "s32", 1), constant(scribe, "s32", 0)
    chosen = reduce_sum(select(below, one, none), 1)
    # Rounding can leave u * total on the last kept rank's cumulative value: stay inside the kept prefix.
    kept = reduce_sum(select(compare(probs, 0.0, "GT"), one, none), 1)
    chosen = minimum(chosen, subtract(kept, 1))
    rank = iota(scribe, "s32", dims, 1)
    return _pick(ids, rank, chosen), new_state


def best_candidate(values: HloValue, ids: HloValue) -> HloValue:
    """s32[b]: the id of the largest of candidates f32[b, n] whose token ids are ids s32[b, n];
    ties go to the smallest id (greedy() over candidates that carry their own ids)."""
    best = reduce_max(values, 1)
    hit = compare(values, expand(best, values.dims, 1), "EQ")
    return reduce_min(select(hit, ids, highest_value("s32")), 1)


def gather_candidates(values: HloValue, ids: HloValue,
                      replica_groups: Sequence[Sequence[int]]) -> tuple[HloValue, HloValue]:
    """(values f32[b, g * k], ids s32[b, g * k]): the candidates values f32[b, k] with token ids
    s32[b, k] of the g replicas of the group, replica by replica, on every one of them.

    One all-gather carries both: the values' bits beside the ids.
    """
    if values.dtype != "f32" or ids.dtype != "s32" or values.dims != ids.dims:
        raise ValueError(f"gather_candidates: f32 values and s32 ids of one shape, got {values.shape!r}, "
                         f"{ids.shape!r}")
    b, k = values.dims
    both = all_gather(concatenate([bitcast_convert(values, "s32"), ids], 1), 1, replica_groups)
    g = both.dims[1] // (2 * k)
    both = reshape(both, (b, g, 2, k))

    def part(i: int) -> HloValue:
        return reshape(slice_along(both, 2, i, i + 1), (b, g * k))

    return bitcast_convert(part(0), "f32"), part(1)


def greedy_sharded(logits: HloValue, first_id: HloValue, replica_groups: Sequence[Sequence[int]]) -> HloValue:
    """s32[b]: greedy() of logits split by columns over the replicas of a group.

    This replica holds logits f32[b, w] of token ids first_id .. first_id + w - 1 (s32
    scalar). Each replica's best logit and its id are gathered ([b, g] each, not the
    logits); every replica returns the same tokens, ties to the smallest id.
    """
    b = logits.dims[0]
    best = reshape(reduce_max(logits, 1), (b, 1))
    ids = reshape(add(argmax(logits, 1), first_id), (b, 1))
    return best_candidate(*gather_candidates(best, ids, replica_groups))


def sample_sharded(logits: HloValue, first_id: HloValue, k_per_line: HloValue, top_p: HloValue,
                   temperature: HloValue, state: HloValue, k_max: int,
                   replica_groups: Sequence[Sequence[int]]) -> tuple[HloValue, HloValue]:
    """(tokens s32[b], new state): sample() of logits split by columns over the replicas of a group
    (held as in greedy_sharded).

    Each replica's top min(k_max, w) logits and their ids are gathered. The k_max largest
    logits of the vocabulary are among them, so the draw over the gathered candidates, with
    the same state on every replica, is sample()'s over the whole vocabulary, and every
    replica draws the same token.
    """
    b, width = logits.dims
    values, columns = top_k(convert(logits, "f32"), min(k_max, width))
    values, ids = gather_candidates(values, add(columns, first_id), replica_groups)
    chosen, new_state = sample(values, k_per_line, top_p, temperature, state, k_max)
    return _pick(ids, iota(logits.scribe, "s32", ids.dims, 1), chosen), new_state
