"""The numbers behind a bench row: medians, decode speed, the roofline, per-bucket step times.

Everything here is pure (no timing, no models), so it is tested on made-up numbers.
"""
from __future__ import annotations

import bisect
import math
import statistics
from typing import Iterable, Sequence


# -- statistics ------------------------------------------------------------------
def summarize(values: Iterable[float]) -> dict | None:
    """Median, min and max of the samples (None when there are none)."""
    samples = [float(v) for v in values]
    if not samples:
        return None
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples),
            "n": len(samples), "samples": samples}


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def median_of(summary: dict | None) -> float | None:
    return None if summary is None else summary["median"]


def decode_metrics(ttft_s: float, total_s: float, new_tokens: int, batch: int) -> dict:
    """One generation's speed: decode is everything after the first token.

    ms_per_step: (total - ttft) / (new_tokens - 1); tokens_per_s adds up the batch lines.
    """
    if new_tokens < 2:
        raise ValueError(f"decode speed needs at least 2 new tokens, got {new_tokens}")
    step_s = (total_s - ttft_s) / (new_tokens - 1)
    return {"ttft_ms": ttft_s * 1e3, "ms_per_step": step_s * 1e3,
            "tokens_per_s": batch / step_s if step_s > 0 else math.inf}


def matching_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# -- roofline ----------------------------------------------------------------------
def roofline_ms(weight_bytes: float, bandwidth_bytes_per_s: float) -> float:
    """The least time a decode step can take: every weight read once from memory."""
    return weight_bytes / bandwidth_bytes_per_s * 1e3


def prefill_rate(ttft_ms: dict | None, prompt_tokens: int, batch: int) -> dict | None:
    """Prompt tokens per second over the time to the first token (the prefill of every line's
    prompt and the first token), from each sample of the TTFT summary."""
    if ttft_ms is None:
        return None
    return summarize(batch * prompt_tokens / (ms / 1e3) for ms in ttft_ms["samples"])


def roofline_fraction(weight_bytes: float, bandwidth_bytes_per_s: float | None,
                      ms_per_step: float | None) -> float | None:
    """Share of the memory-bandwidth bound reached: roofline ms / measured ms per step."""
    if not bandwidth_bytes_per_s or not ms_per_step:
        return None
    return roofline_ms(weight_bytes, bandwidth_bytes_per_s) / ms_per_step


def bucket_rows(step_ms: Sequence[float], prompt_length: int, buckets: Sequence[int]) -> list[dict]:
    """Group per-step decode times by the token bucket each step ran in.

    step_ms[j] is the time between new tokens j and j + 1 (from 0): that step fed token j
    to the model with prompt_length + j + 1 tokens in the cache, so it ran in the bucket
    pick(buckets, prompt_length + j + 1).
    """
    grouped: dict[int, list[float]] = {b: [] for b in buckets}
    for j, ms in enumerate(step_ms):
        i = bisect.bisect_left(buckets, prompt_length + j + 1)
        if i < len(buckets):
            grouped[buckets[i]].append(ms)
    rows = [{"bucket": b, "ms_per_step": summarize(v)} for b, v in grouped.items() if v]
    largest = rows[-1]["ms_per_step"]["median"] if rows else None
    for row in rows:
        row["vs_largest"] = ratio(largest, row["ms_per_step"]["median"])
    return rows
