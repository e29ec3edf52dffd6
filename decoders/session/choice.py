"""Choosing tokens on the host from f32 logits: greedy, or HF transformers' temperature,
top-k and top-p warpers and a seeded torch generator (sample() chooses on the device).
Speculative decoding (here) and serving's scheduler (serving/scheduler.py) both use it, so
it lives in decoders, which serving imports and never the other way round."""
from __future__ import annotations

from typing import Any

import numpy as np

# Temperatures below this choose greedily: logits divided by them overflow f32 (a logit of 10
# over 1e-38 is past f32's largest value), and the distribution is one-hot long before that.
GREEDY_BELOW = 1e-5


def probabilities(logits: np.ndarray, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> Any:
    """torch f32 [rows, vocab]: softmax of the logits [rows, vocab] (or [vocab]) after HF's
    warpers (temperature, then top-k, then top-p, as generate() orders them).

    Any temperature > 0 and top_p > 0 gives a distribution: below GREEDY_BELOW the
    temperature gives the argmax all the mass; a huge one gives the uniform distribution
    (softmax subtracts the maximum, so no exp overflows); top_p near 0 keeps the top token."""
    import torch
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    if temperature < GREEDY_BELOW:
        rows = np.asarray(logits, np.float32).reshape(-1, logits.shape[-1])
        greedy = torch.zeros(rows.shape, dtype=torch.float32)
        greedy[torch.arange(rows.shape[0]), torch.from_numpy(np.argmax(rows, axis=-1))] = 1.0
        return greedy
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    scores = torch.from_numpy(np.ascontiguousarray(logits, np.float32)).reshape(-1, logits.shape[-1])
    return torch.softmax(warpers(None, scores), dim=-1)


def penalized(logits: np.ndarray, prompt: list[int], generated: list[int], repetition_penalty: float = 1.0,
              presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
              logit_bias: dict[int, float] | None = None) -> np.ndarray:
    """The logits [vocab] of a sequence's next token after, in vLLM's order: logit_bias added
    (OpenAI's), HF's repetition penalty over the prompt and the generated tokens (vLLM's and
    HF's), then OpenAI's presence and frequency penalties over the generated tokens:
    logit[j] -= frequency_penalty * count[j] + presence_penalty * (count[j] > 0)."""
    out = np.array(logits, np.float32, copy=True).reshape(-1)
    if logit_bias:
        ids = np.fromiter(logit_bias, np.int64, len(logit_bias))
        np.add.at(out, ids, np.fromiter(logit_bias.values(), np.float32, len(logit_bias)))
    if repetition_penalty != 1.0 and (prompt or generated):
        import torch
        from transformers import RepetitionPenaltyLogitsProcessor

        seen = torch.tensor([list(prompt) + list(generated)], dtype=torch.long)
        scores = RepetitionPenaltyLogitsProcessor(repetition_penalty)(seen, torch.from_numpy(out)[None])
        out = scores[0].numpy()
    if (presence_penalty or frequency_penalty) and generated:
        counts = np.bincount(np.asarray(generated, np.int64), minlength=out.shape[0])[:out.shape[0]]
        out = out - frequency_penalty * counts - presence_penalty * (counts > 0)
    return out.astype(np.float32, copy=False)


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
