"""Sampling on the device: greedy, top-k, top-p, temperature and seeds, through sample()."""
from __future__ import annotations

import pytest
import torch

from decoders import LlamaForSampling


@pytest.fixture(scope="module")
def model(tiny_llama):
    _, path = tiny_llama("mha", "safetensors")
    return LlamaForSampling.from_pretrained(path, batch_size=2, n_positions=128,
                                            context_length_estimate=[16]).to_neuron()


PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]


def drawn_at(tokens, step):
    """The token each line drew at `step` (lines start after prompts of different lengths)."""
    return [int(tokens[i, len(p) + step]) for i, p in enumerate(PROMPTS)]


def test_top_k_1_is_greedy_and_a_tiny_top_p_is_greedy_too(model):
    greedy = model.sample(PROMPTS, sequence_length=30, top_k=1, eos_token_id=[])
    nucleus_of_one = model.sample(PROMPTS, sequence_length=30, top_k=50, top_p=1e-6, eos_token_id=[], seed=0)
    assert torch.equal(greedy, nucleus_of_one)


def test_a_fixed_seed_reproduces_a_run_and_another_seed_differs(model):
    first = model.sample(PROMPTS, sequence_length=40, top_k=50, temperature=1.5, seed=7, eos_token_id=[])
    again = model.sample(PROMPTS, sequence_length=40, top_k=50, temperature=1.5, seed=7, eos_token_id=[])
    other = model.sample(PROMPTS, sequence_length=40, top_k=50, temperature=1.5, seed=8, eos_token_id=[])
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_top_k_draws_only_among_the_k_most_likely(model):
    tokens, scores = model.sample(PROMPTS, sequence_length=60, top_k=3, temperature=2.0, seed=1,
                                  eos_token_id=[], output_scores=True)
    for step, logits in enumerate(scores):
        drawn = drawn_at(tokens, step)
        allowed = logits.topk(3, dim=-1).indices.tolist()
        assert all(drawn[i] in allowed[i] for i in range(2)), step


def test_top_p_draws_only_from_the_nucleus(model):
    tokens, scores = model.sample(PROMPTS, sequence_length=60, top_k=320, top_p=0.5, seed=2,
                                  eos_token_id=[], output_scores=True)
    for step, logits in enumerate(scores):
        probs = logits.softmax(-1)
        for i in range(2):
            ordered, ids = probs[i].sort(descending=True)
            before = ordered.cumsum(0) - ordered       # mass of the strictly more likely tokens
            nucleus = set(ids[before < 0.5].tolist())
            assert drawn_at(tokens, step)[i] in nucleus, (step, i)


def test_per_line_sampling_parameters(model):
    out = model.sample(PROMPTS, sequence_length=20, top_k=[1, 40], temperature=[1.0, 0.7], seed=3,
                       eos_token_id=[])
    greedy = model.sample(PROMPTS, sequence_length=20, top_k=1, eos_token_id=[])
    assert torch.equal(out[0], greedy[0])


def test_streamer_sees_the_prompt_then_every_new_token(model):
    class Recorder:
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.clone())

        def end(self):
            self.ended = True

    recorder = Recorder()
    out = model.sample(PROMPTS, sequence_length=20, top_k=1, eos_token_id=[], streamer=recorder)
    assert recorder.ended and len(recorder.chunks) == 1 + 12
    streamed = torch.cat(recorder.chunks[1:], dim=1)
    for i, prompt in enumerate(PROMPTS):
        assert streamed[i].tolist() == out[i, len(prompt): len(prompt) + 12].tolist()


def test_stopping_criteria_end_the_loop(model):
    calls = []

    def stop_after_five_new(input_ids, scores):
        calls.append(input_ids.shape[1])
        return input_ids.shape[1] >= 13

    out = model.sample(PROMPTS, sequence_length=60, top_k=1, eos_token_id=[],
                       stopping_criteria_list=[stop_after_five_new])
    assert calls and out.shape[1] == 13


def test_no_repeat_ngram_size_bans_repeated_bigrams(model):
    out = model.sample(PROMPTS, sequence_length=80, top_k=1, eos_token_id=[], no_repeat_ngram_size=2)
    new_tokens = 80 - len(PROMPTS[0])
    for prompt, line in zip(PROMPTS, out.tolist()):
        line = line[: len(prompt) + new_tokens]       # past that, the shorter line is padding
        bigrams = list(zip(line, line[1:]))
        assert len(bigrams) == len(set(bigrams))
