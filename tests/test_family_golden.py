"""GPT-NeoX and Bloom against HF transformers' own models on the same tiny random weights.

Logits within 1e-4 (relative to the largest logit) over prefill and 20 decode steps,
identical greedy tokens over 110 new tokens crossing the 128 -> 256 token bucket, at batch 1
and at batch 2 with different prompt lengths, with and without pyhlo's CPU kernels.
"""
from __future__ import annotations

import pytest
import torch
from test_llama_golden import hf_greedy, relative_error
from tiny_families import make_model, save

from decoders import BloomForSampling, GPTNeoXForSampling, NeuronConfig

CLASSES = {"gpt_neox": GPTNeoXForSampling, "gpt_neox_sequential": GPTNeoXForSampling, "bloom": BloomForSampling}
KERNELS = pytest.mark.parametrize("kernels", [True, False], ids=["cpu_kernels", "xla_dot"])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made = {}

    def get(variant):
        if variant not in made:
            model = make_model(variant)
            made[variant] = (model, save(model, tmp_path_factory.mktemp(variant)))
        return made[variant]

    return get


def build(cls, path, kernels, batch_size=1):
    return cls.from_pretrained(path, batch_size=batch_size, n_positions=256, context_length_estimate=[16, 64],
                               neuron_config=NeuronConfig(cpu_kernels=kernels)).to_neuron()


@KERNELS
@pytest.mark.parametrize("variant", list(CLASSES))
def test_logits_and_greedy_tokens_match_hf(checkpoint, variant, kernels):
    hf, path = checkpoint(variant)
    model = build(CLASSES[variant], path, kernels)
    prompt = torch.randint(0, 320, (1, 40), generator=torch.Generator().manual_seed(1))
    length = 150                                   # 110 new tokens: decode crosses 128 -> 256
    expected, expected_logits = hf_greedy(hf, prompt, length)
    tokens, logits = model.sample(prompt, sequence_length=length, top_k=1, eos_token_id=[], output_scores=True)
    assert torch.equal(tokens, expected)
    for step in range(21):                         # prefill + 20 decode steps
        assert relative_error(logits[step], expected_logits[step]) < 1e-4, step


@KERNELS
@pytest.mark.parametrize("variant", ["gpt_neox", "bloom"])
def test_batch_of_different_prompt_lengths(checkpoint, variant, kernels):
    hf, path = checkpoint(variant)
    model = build(CLASSES[variant], path, kernels, batch_size=2)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 320, (n,), generator=gen) for n in (9, 30)]
    length = 150
    tokens, logits = model.sample(prompts, sequence_length=length, top_k=1, eos_token_id=[], output_scores=True)
    new_tokens = length - 30                       # the longest prompt sets the step count
    for i, prompt in enumerate(prompts):
        expected, expected_logits = hf_greedy(hf, prompt[None], len(prompt) + new_tokens)
        assert tokens[i, : len(prompt) + new_tokens].tolist() == expected[0].tolist(), i
        for step in range(21):
            assert relative_error(logits[step][i], expected_logits[step][0]) < 1e-4, (i, step)
