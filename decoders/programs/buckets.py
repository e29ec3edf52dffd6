"""Sequence-length buckets: which compiled program serves a given length.

Token-generation buckets are powers of two from 128 up to `n_positions` (the last
bucket is `n_positions` itself). Context (prefill) buckets default to half of each
token bucket. Explicit lists override both. At run time the smallest bucket that
fits is used.
"""
from __future__ import annotations

import bisect
from typing import Sequence


def token_buckets(n_positions: int | Sequence[int]) -> list[int]:
    """The cache lengths attention is compiled for; the largest is the cache size."""
    if not isinstance(n_positions, int):
        buckets = sorted({int(b) for b in n_positions})
        if not buckets or buckets[0] < 1:
            raise ValueError(f"n_positions buckets must be positive, got {list(n_positions)}")
        return buckets
    if n_positions < 1:
        raise ValueError(f"n_positions must be positive, got {n_positions}")
    buckets = []
    size = 128
    while size < n_positions:
        buckets.append(size)
        size *= 2
    buckets.append(n_positions)
    return buckets


def context_buckets(token_bucket_list: Sequence[int],
                    context_length_estimate: int | Sequence[int] | None = None) -> list[int]:
    """Prompt lengths the prefill is compiled for (prompts are processed in chunks of these)."""
    largest = max(token_bucket_list)
    if context_length_estimate is None:
        buckets = {max(1, b // 2) for b in token_bucket_list}
    elif isinstance(context_length_estimate, int):
        buckets = {context_length_estimate}
    else:
        buckets = {int(b) for b in context_length_estimate}
    if not buckets or min(buckets) < 1:
        raise ValueError(f"context_length_estimate must be positive, got {context_length_estimate}")
    if max(buckets) > largest:
        raise ValueError(
            f"context_length_estimate {max(buckets)} exceeds n_positions {largest}; "
            "lower it or raise n_positions"
        )
    return sorted(buckets)


def pick(buckets: Sequence[int], length: int) -> int:
    """The smallest bucket >= length, or ValueError naming both when none fits."""
    i = bisect.bisect_left(buckets, length)
    if i == len(buckets):
        raise ValueError(f"length {length} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]
