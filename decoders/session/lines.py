"""transformers-neuronx's continuous-batching forward(): sequences addressed by their line.

    model.forward(input_ids, cache_ids, start_ids=seq_ids)

input_ids [k, n] are the next n tokens of k sequences; seq_ids [k] the batch lines (KV cache
lines) they live in; cache_ids [k, n] their positions, consecutive in each row (or [k] for
one token each; None: a new prompt from position 0). Lines not named keep their caches. The
result is the f32 logits [k, vocab] of each row's last token, rows in the given order
(run_sequences, over the Session's continuous-batching entry points).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from decoders.programs import buckets as bucketing


def _as_array(value: Any, dtype: Any = np.int64) -> np.ndarray:
    return np.asarray(value.tolist() if hasattr(value, "tolist") else value, dtype)


def sequence_lines(seq_ids: Any, rows: int, batch_size: int) -> np.ndarray:
    """The batch line of each row (distinct lines in 0 .. batch_size - 1)."""
    if seq_ids is None:
        raise ValueError("a continuous-batching model needs start_ids=seq_ids: the batch line of each row")
    lines = _as_array(seq_ids).reshape(-1)
    if (lines.shape != (rows,) or len(set(lines.tolist())) != rows or (lines < 0).any()
            or (lines >= batch_size).any()):
        raise ValueError(f"start_ids (seq_ids) must be {rows} distinct batch lines in 0..{batch_size - 1}, "
                         f"one per row of input_ids; got {lines.tolist()}")
    return lines


def first_positions(cache_ids: Any, rows: int, n_tokens: int, n_positions: int) -> np.ndarray:
    """Each row's first cache position, from cache_ids [rows, n] (consecutive) or [rows] (n = 1)."""
    if cache_ids is None:
        if n_tokens == 1:
            raise ValueError("cache_ids is needed for a step of one token per sequence: each sequence's "
                             "position")
        return np.zeros(rows, np.int64)
    ids = _as_array(cache_ids)
    if ids.ndim == 1 and n_tokens == 1:
        ids = ids.reshape(rows, 1) if ids.shape == (rows,) else ids
    if ids.shape != (rows, n_tokens) or not (ids == ids[:, :1] + np.arange(n_tokens)).all():
        raise ValueError(f"cache_ids must be [{rows}, {n_tokens}]: each row's consecutive positions; got "
                         f"{ids.tolist()}")
    if (ids[:, 0] < 0).any() or (ids[:, -1] >= n_positions).any():
        raise ValueError(f"cache_ids must lie in 0..{n_positions - 1} (n_positions); got rows from "
                         f"{ids[:, 0].tolist()} to {ids[:, -1].tolist()}")
    return ids[:, 0]


def run_sequences(session: Any, token_ids: np.ndarray, cache_ids: Any, seq_ids: Any) -> np.ndarray:
    """Logits [k, vocab] (numpy f32) of each row's last token, the rows written into their lines."""
    rows, n = token_ids.shape
    b, n_positions = session.batch_size, session.n_positions
    lines = sequence_lines(seq_ids, rows, b)
    first = first_positions(cache_ids, rows, n, n_positions)
    largest = session.context_buckets[-1]
    if n == 1 and rows <= max(session.decode_rows(), default=0):
        # A token for each of a few lines: the programs for that many rows.
        return session.host_logits(session.decode_lines(token_ids[:, 0], lines, first))[:rows]
    if n > 1 and rows < b and session.row_prefill:
        # A prompt per row, each through the programs for its line alone.
        return np.concatenate([_prefill_line(session, token_ids[i], int(lines[i]), int(first[i]))
                               for i in range(rows)])
    done = 0
    while done < n:
        size = min(n - done, largest)
        width = 1 if size == 1 else bucketing.pick(session.context_buckets, size)
        chunk = np.zeros((b, width), np.int32)
        chunk[lines, :size] = token_ids[:, done:done + size]
        slots = np.full(b, n_positions, np.int32)
        slots[lines] = first + done
        last_index = np.zeros(b, np.int32)
        last_index[lines] = size - 1
        logits = session.step_every_line(chunk, slots, last_index)
        done += size
    return session.host_logits(logits)[lines]


def _prefill_line(session: Any, tokens: np.ndarray, line: int, first: int) -> np.ndarray:
    """Logits [1, vocab] of the last of `tokens` written into `line` from slot `first`."""
    largest, done = session.context_buckets[-1], 0
    while done < len(tokens):
        size = min(len(tokens) - done, largest)
        chunk = np.zeros((1, bucketing.pick(session.context_buckets, size)), np.int32)
        chunk[0, :size] = tokens[done:done + size]
        logits = session.prefill_line(chunk, line, first + done, size - 1)
        done += size
    return session.host_logits(logits)
