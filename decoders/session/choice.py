"""Choosing tokens on the host from f32 logits: greedy, or HF transformers' temperature,
top-k and top-p warpers and a seeded torch generator (sample() chooses on the device).
Speculative decoding (here) and serving's scheduler (serving/scheduler.py) both use it, so
it lives in decoders, which serving imports and never the other way round."""
from __future__ import annotations

from typing import Any

import numpy as np


def probabilities(logits: np.ndarray, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> Any:
    """torch f32 [rows, vocab]: softmax of the logits [rows, vocab] (or [vocab]) after HF's
    warpers (temperature, then top-k, then top-p, as generate() orders them)."""
    import torch
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    scores = torch.from_numpy(np.ascontiguousarray(logits, np.float32)).reshape(-1, logits.shape[-1])
    return torch.softmax(warpers(None, scores), dim=-1)


def draw(probs: Any, generator: Any) -> int:
    """One token id drawn from probs [vocab] (or [1, vocab])."""
    import torch

    return int(torch.multinomial(probs.reshape(1, -1), 1, generator=generator)[0, 0])


def seeded_generator(seed: int | None) -> Any:
    """A torch generator seeded with `seed` (a fresh random seed when None)."""
    import torch

    generator = torch.Generator()
    generator.manual_seed(seed if seed is not None else int(np.random.SeedSequence().generate_state(1)[0]))
    return generator
