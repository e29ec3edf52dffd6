"""sample()'s decode loop keeps a few steps in flight: the host reads each step's tokens
while the next steps already run, and still sees every token in order."""
from __future__ import annotations

import torch
from transformers import StoppingCriteria

from decoders import LlamaForSampling
from decoders.session import generation
from decoders.session.session import Session


class StopAfter(StoppingCriteria):
    def __init__(self, length: int):
        self.length = length
        self.seen: list[int] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.seen.append(input_ids.shape[1])
        return input_ids.shape[1] >= self.length


def test_steps_in_flight_are_bounded_and_every_token_is_seen(tiny_llama, monkeypatch):
    hf, path = tiny_llama("mha", "safetensors")
    model = LlamaForSampling.from_pretrained(path, batch_size=1, n_positions=128,
                                             context_length_estimate=[16]).to_neuron()
    prompt = torch.randint(0, 320, (1, 9), generator=torch.Generator().manual_seed(5))
    decode_steps, copies = [], []
    real_decode = Session.decode

    def counting_decode(self, token_ids, slot, pads):
        decode_steps.append(slot)
        return real_decode(self, token_ids, slot, pads)

    monkeypatch.setattr(Session, "decode", counting_decode)
    placement = model.session.placement
    real_copy = placement.start_host_copy
    monkeypatch.setattr(placement, "start_host_copy", lambda v: copies.append(v) or real_copy(v))
    stop = StopAfter(9 + 6)
    tokens = model.sample(prompt, sequence_length=60, top_k=1, eos_token_id=[], stopping_criteria_list=[stop])
    expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_length=15, do_sample=False,
                           pad_token_id=0)
    assert tokens.tolist() == expected.tolist()
    assert stop.seen == list(range(10, 16))                      # every token, in order, one at a time
    # 6 tokens read: the first from the prefill, 5 decode steps to make the rest, and up to
    # STEPS_IN_FLIGHT launched ahead of the last one read.
    assert 5 <= len(decode_steps) <= 5 + generation.STEPS_IN_FLIGHT
    assert decode_steps == list(range(9, 9 + len(decode_steps)))
    assert len(copies) == 1 + len(decode_steps)                  # each step's tokens start home at once


def test_no_step_runs_ahead_where_the_host_must_see_the_tokens_first(tiny_llama, monkeypatch):
    """n-gram bans need each token on the host before the next step's logits are masked."""
    _, path = tiny_llama("mha", "safetensors")
    model = LlamaForSampling.from_pretrained(path, batch_size=1, n_positions=128,
                                             context_length_estimate=[16]).to_neuron()
    prompt = torch.randint(0, 320, (1, 9), generator=torch.Generator().manual_seed(5))
    launched = []
    real_decode = Session.decode
    monkeypatch.setattr(Session, "decode",
                        lambda self, t, s, p: launched.append(s) or real_decode(self, t, s, p))
    stop = StopAfter(9 + 4)
    model.sample(prompt, sequence_length=60, top_k=1, eos_token_id=[], no_repeat_ngram_size=3,
                 stopping_criteria_list=[stop])
    assert launched == [9, 10, 11]                               # after the prefill, one step per token read


def test_a_greedy_decode_step_is_one_program(tiny_llama, monkeypatch):
    """The whole-model decode program returns each line's most likely token beside the
    logits: greedy sampling launches no separate greedy program per token."""
    from decoders import NeuronConfig
    from decoders.programs.keys import Greedy

    hf, path = tiny_llama("mha", "safetensors")
    model = LlamaForSampling.from_pretrained(path, batch_size=2, n_positions=128,
                                             context_length_estimate=[16],
                                             neuron_config=NeuronConfig(whole_model_program=True)).to_neuron()
    greedy = model.programs.get(Greedy())
    runs = []
    real_run = greedy.run_checked_once
    monkeypatch.setattr(greedy, "run_checked_once", lambda values: runs.append(1) or real_run(values))
    prompt = torch.randint(0, 320, (2, 9), generator=torch.Generator().manual_seed(8))
    tokens = model.sample(prompt, sequence_length=40, top_k=1, eos_token_id=[])
    assert len(runs) == 1                                        # the prefill's token only
    expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_length=40, min_length=40,
                           do_sample=False, pad_token_id=0)
    assert tokens.tolist() == expected.tolist()
