"""Every family but Llama (tests/test_llama_golden.py) against HF transformers' own model on
the same tiny random weights (tests/tiny_families.py), the class picked by model_type.

Logits within 1e-4 (relative to the largest logit) over prefill and 20 decode steps,
identical greedy tokens over 110 new tokens crossing the 128 -> 256 token bucket, at batch 1
and at batch 2 with different prompt lengths, with and without pyhlo's CPU kernels.
"""
from __future__ import annotations

import pytest
import torch
from test_llama_golden import hf_greedy, relative_error
from tiny_families import VARIANTS

from decoders import NeuronAutoModelForCausalLM, NeuronConfig

KERNELS = pytest.mark.parametrize("kernels", [pytest.param(True, marks=pytest.mark.cpu_only), False],
                                  ids=["cpu_kernels", "xla_dot"])
ALL_VARIANTS = pytest.mark.parametrize("variant", list(VARIANTS))


def build(path, kernels, batch_size=1):
    return NeuronAutoModelForCausalLM.from_pretrained(
        path, batch_size=batch_size, n_positions=256, context_length_estimate=[16, 64],
        neuron_config=NeuronConfig(cpu_kernels=kernels)).to_neuron()


@KERNELS
@ALL_VARIANTS
def test_logits_and_greedy_tokens_match_hf(family_checkpoint, variant, kernels):
    hf, path = family_checkpoint(variant)
    model = build(path, kernels)
    prompt = torch.randint(0, 320, (1, 40), generator=torch.Generator().manual_seed(1))
    length = 150                                   # 110 new tokens: decode crosses 128 -> 256
    expected, expected_logits = hf_greedy(hf, prompt, length)
    tokens, logits = model.sample(prompt, sequence_length=length, top_k=1, eos_token_id=[],
                                  output_scores=True)
    assert torch.equal(tokens, expected)
    for step in range(21):                         # prefill + 20 decode steps
        assert relative_error(logits[step], expected_logits[step]) < 1e-4, step


@KERNELS
@ALL_VARIANTS
def test_batch_of_different_prompt_lengths(family_checkpoint, variant, kernels):
    hf, path = family_checkpoint(variant)
    model = build(path, kernels, batch_size=2)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 320, (n,), generator=gen) for n in (9, 30)]
    length = 150
    tokens, logits = model.sample(prompts, sequence_length=length, top_k=1, eos_token_id=[],
                                  output_scores=True)
    new_tokens = length - 30                       # the longest prompt sets the step count
    for i, prompt in enumerate(prompts):
        expected, expected_logits = hf_greedy(hf, prompt[None], len(prompt) + new_tokens)
        assert tokens[i, : len(prompt) + new_tokens].tolist() == expected[0].tolist(), i
        for step in range(21):
            assert relative_error(logits[step][i], expected_logits[step][0]) < 1e-4, (i, step)
