"""Validation of sample() arguments: prompts, lengths and sampling parameters."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np


@dataclass(frozen=True)
class Prompts:
    """Per-line token ids (no padding), left-padded into one block for the device."""

    lines: tuple[tuple[int, ...], ...]

    @property
    def batch_size(self) -> int:
        return len(self.lines)

    @property
    def longest(self) -> int:
        return max(len(line) for line in self.lines)

    def pads(self) -> np.ndarray:
        """How many pad slots precede each line when all end at slot `longest`."""
        return np.array([self.longest - len(line) for line in self.lines], dtype=np.int32)

    def left_padded(self, pad_id: int = 0) -> np.ndarray:
        block = np.full((self.batch_size, self.longest), pad_id, dtype=np.int32)
        for i, line in enumerate(self.lines):
            block[i, self.longest - len(line):] = line
        return block


def _as_int_array(value: Any, what: str) -> np.ndarray:
    try:
        import torch

        if isinstance(value, torch.Tensor):
            if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
                raise ValueError(f"{what} must hold integer token ids, got a {value.dtype} tensor")
            return value.detach().cpu().numpy()
    except ImportError:  # pragma: no cover
        pass
    array = np.asarray(value)
    if array.dtype == object:
        raise ValueError(f"{what} rows have different lengths: pass a list of sequences instead")
    if array.size and array.dtype.kind not in "iu":
        raise ValueError(f"{what} must hold integer token ids, got dtype {array.dtype}")
    return array


def parse_prompts(input_ids: Any, attention_mask: Any = None, vocab_size: int | None = None) -> Prompts:
    """Accepts a [batch, length] tensor/array (with an optional 0/1 attention_mask marking
    padding, left or right), or a list of 1-D sequences of different lengths."""
    if isinstance(input_ids, (list, tuple)) and input_ids and not np.isscalar(input_ids[0]):
        rows = [_as_int_array(row, "input_ids").reshape(-1) for row in input_ids]
        if attention_mask is not None:
            raise ValueError("attention_mask goes with a [batch, length] input_ids, not a list of sequences")
    else:
        array = _as_int_array(input_ids, "input_ids")
        if array.ndim == 1:
            array = array[None, :]
        if array.ndim != 2:
            raise ValueError(f"input_ids must be [batch, length], got shape {list(array.shape)}")
        if attention_mask is not None:
            mask = _as_int_array(attention_mask, "attention_mask")
            if mask.shape != array.shape:
                raise ValueError(
                    f"attention_mask shape {list(mask.shape)} differs from input_ids {list(array.shape)}"
                )
            rows = [row[m.astype(bool)] for row, m in zip(array, mask)]
        else:
            rows = list(array)
    if not rows:
        raise ValueError("input_ids is empty: give at least one prompt")
    for i, row in enumerate(rows):
        if row.size == 0:
            raise ValueError(f"prompt {i} is empty: every batch line needs at least one token")
        if vocab_size is not None and (row.min() < 0 or row.max() >= vocab_size):
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab_size})")
    return Prompts(tuple(tuple(int(t) for t in row) for row in rows))


def per_line(value: Any, batch_size: int, name: str) -> list:
    """A scalar for every line, or a list with one value per line."""
    if isinstance(value, (list, tuple, np.ndarray)):
        if len(value) != batch_size:
            raise ValueError(f"{name} has {len(value)} values for {batch_size} batch lines")
        return list(value)
    return [value] * batch_size


def check_sampling(top_k: Sequence, top_p: Sequence, temperature: Sequence) -> None:
    for k in top_k:
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"top_k must be an int >= 1, got {k!r}")
    for p in top_p:
        if not 0.0 < float(p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
    for t in temperature:
        if not float(t) > 0.0:
            raise ValueError(f"temperature must be > 0, got {t!r}")
