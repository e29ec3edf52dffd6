"""sample()'s arguments checked, and the layout of its output.

Prompts come in two forms, each giving back its own layout:

- a [batch, length] tensor or array, padded (left or right) as transformers-neuronx and HF
  generate() take it, with `attention_mask` (1 = real token) or `start_ids` (the offset of
  each line's first real token, left padding): the output is [batch, length + new tokens],
  each line its input row exactly as given followed by its new tokens, so
  `out[:, input_ids.shape[1]:]` are the new tokens;
- a list of 1-D sequences of different lengths: each output line is its prompt followed by
  its new tokens.

Lines that end early (EOS, stopping criteria) are right-padded with the EOS id.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np


@dataclass(frozen=True)
class Prompts:
    """Per-line real token ids (no padding), and the padded block they came in, if any."""

    lines: tuple[tuple[int, ...], ...]
    given: np.ndarray | None = None     # the [batch, length] input as given (None: a list)

    @property
    def batch_size(self) -> int:
        return len(self.lines)

    @property
    def longest(self) -> int:
        return max(len(line) for line in self.lines)

    @property
    def width(self) -> int:
        """Output columns the prompts take: the given tensor's length, or the longest prompt."""
        return self.given.shape[1] if self.given is not None else self.longest

    def pads(self) -> np.ndarray:
        """How many pad slots precede each line when all end at slot `longest`."""
        return np.array([self.longest - len(line) for line in self.lines], dtype=np.int32)

    def left_padded(self, pad_id: int = 0) -> np.ndarray:
        block = np.full((self.batch_size, self.longest), pad_id, dtype=np.int32)
        for i, line in enumerate(self.lines):
            block[i, self.longest - len(line):] = line
        return block

    def as_given(self) -> np.ndarray:
        """The prompts as the caller laid them out (a list: left-padded with zeros)."""
        return self.given if self.given is not None else self.left_padded()

    def layout(self, new_tokens: Sequence[Sequence[int]], pad_id: int) -> np.ndarray:
        """The output block: prompts in the caller's layout, then each line's new tokens."""
        width = self.width + max((len(t) for t in new_tokens), default=0)
        if self.given is None:
            width = max(len(line) + len(t) for line, t in zip(self.lines, new_tokens))
        out = np.full((self.batch_size, width), pad_id, dtype=np.int64)
        for i, (line, tokens) in enumerate(zip(self.lines, new_tokens)):
            head = self.given[i] if self.given is not None else line
            out[i, :len(head)] = head
            out[i, len(head):len(head) + len(tokens)] = tokens
        return out


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


def _mask_from_start_ids(start_ids: Any, shape: tuple[int, int]) -> np.ndarray:
    starts = _as_int_array(start_ids, "start_ids").reshape(-1)
    batch, length = shape
    if starts.shape != (batch,):
        raise ValueError(f"start_ids has {starts.size} values for {batch} batch lines: give one offset per "
                         "line")
    if starts.min() < 0 or starts.max() >= length:
        raise ValueError(f"start_ids must be offsets in [0, {length - 1}] (the first real token of each "
                         f"left-padded line), got {starts.tolist()}")
    return (np.arange(length)[None, :] >= starts[:, None]).astype(np.int64)


def parse_prompts(input_ids: Any, attention_mask: Any = None, vocab_size: int | None = None,
                  start_ids: Any = None) -> Prompts:
    """Accepts a [batch, length] tensor/array (padding marked by a 0/1 attention_mask, left or
    right, or by start_ids for left padding), or a list of 1-D sequences of different lengths."""
    given = None
    if isinstance(input_ids, (list, tuple)) and input_ids and not np.isscalar(input_ids[0]):
        rows = [_as_int_array(row, "input_ids").reshape(-1) for row in input_ids]
        if attention_mask is not None or start_ids is not None:
            raise ValueError("attention_mask and start_ids go with a [batch, length] input_ids, "
                             "not a list of sequences (a list carries no padding)")
    else:
        array = _as_int_array(input_ids, "input_ids")
        if array.ndim == 1:
            array = array[None, :]
        if array.ndim != 2:
            raise ValueError(f"input_ids must be [batch, length], got shape {list(array.shape)}")
        given = array
        mask = None
        if attention_mask is not None:
            mask = _as_int_array(attention_mask, "attention_mask")
            if mask.shape != array.shape:
                raise ValueError(
                    f"attention_mask shape {list(mask.shape)} differs from input_ids {list(array.shape)}"
                )
        if start_ids is not None and array.size:
            from_starts = _mask_from_start_ids(start_ids, array.shape)
            if mask is not None and not np.array_equal(mask.astype(bool), from_starts.astype(bool)):
                raise ValueError("start_ids and attention_mask disagree about which tokens are padding; "
                                 "give one of them")
            mask = from_starts
        rows = [row[m.astype(bool)] for row, m in zip(array, mask)] if mask is not None else list(array)
    if not rows:
        raise ValueError("input_ids is empty: give at least one prompt")
    for i, row in enumerate(rows):
        if row.size == 0:
            raise ValueError(f"prompt {i} is empty: every batch line needs at least one token")
        if vocab_size is not None and (row.min() < 0 or row.max() >= vocab_size):
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab_size})")
    return Prompts(tuple(tuple(int(t) for t in row) for row in rows), given)


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
