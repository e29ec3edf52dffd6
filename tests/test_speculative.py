"""Speculative decoding: greedy output equals the target's alone token for token (a draft of
another seed, and the target as its own draft); seeded sampling reproduces; speculative
sampling's acceptance rule gives the target's distribution; the acceptance rate is reported."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from decoders import LlamaForSampling, SpeculativeGenerator
from decoders.session.speculative import accept_drafts

SHAPE = dict(batch_size=1, n_positions=128, context_length_estimate=[16, 32])
PROMPTS = [[5, 6, 7], list(range(20, 45)), [300, 2, 17, 99, 4, 250, 8]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    import tiny_llama

    paths = {}
    for name, seed in (("target", 0), ("draft", 1)):
        paths[name] = tiny_llama.save(tiny_llama.make_model("gqa_tied_llama3", seed=seed),
                                      tmp_path_factory.mktemp(name), "safetensors")
    target = LlamaForSampling.from_pretrained(paths["target"], **SHAPE)
    target.enable_speculative_decoder(4)
    target.to_neuron()
    draft = LlamaForSampling.from_pretrained(paths["draft"], **SHAPE).to_neuron()
    same = LlamaForSampling.from_pretrained(paths["target"], **SHAPE).to_neuron()
    return target, draft, same


@pytest.mark.parametrize("draft_name", ["other_seed", "target_itself"])
def test_greedy_speculation_gives_the_targets_tokens(models, draft_name):
    target, draft, same = models
    generator = SpeculativeGenerator(draft if draft_name == "other_seed" else same, target, 4)
    for prompt in PROMPTS:
        expected = target.sample([prompt], sequence_length=len(prompt) + 40, top_k=1, eos_token_id=[])
        got = generator.sample(torch.tensor([prompt]), sequence_length=len(prompt) + 40, top_k=1,
                               eos_token_id=[])
        assert torch.equal(got, expected), prompt
    if draft_name == "target_itself":
        # Every proposal is the target's own choice: k + 1 tokens per target call.
        assert generator.acceptance_rate == 1.0
        assert generator.target_calls <= 3 * (-(-40 // 5)) + 3
    else:
        assert 0.0 <= generator.acceptance_rate < 1.0


def test_seeded_speculative_sampling_reproduces(models):
    target, draft, _ = models
    generator = SpeculativeGenerator(draft, target, 4)
    runs = [generator.sample([PROMPTS[1]], sequence_length=70, top_k=20, top_p=0.9, temperature=1.2,
                             seed=seed, eos_token_id=[]) for seed in (3, 3, 4)]
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    assert runs[0].shape == (1, 70) and 0.0 <= generator.acceptance_rate <= 1.0


def test_the_acceptance_rule_draws_from_the_targets_distribution():
    """Over many trials on a 6-token vocabulary, the first emitted token of a round follows
    the target's p, whatever the draft's q (chi-square bound), and the kept share is
    sum_x min(p, q)."""
    rng = np.random.default_rng(0)
    p = torch.tensor(rng.dirichlet(np.ones(6)), dtype=torch.float32)
    q = torch.tensor(rng.dirichlet(np.ones(6)), dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    trials, counts, kept_total = 20000, np.zeros(6), 0
    for _ in range(trials):
        draft = int(torch.multinomial(q, 1, generator=generator))
        kept, following = accept_drafts([draft], q.reshape(1, -1), torch.stack([p, p]), generator)
        counts[draft if kept else following] += 1
        kept_total += kept
    expected = p.numpy() * trials
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 25.0, (chi2, counts, expected)          # 5 degrees of freedom: p < 1e-4 when right
    assert abs(kept_total / trials - float(torch.minimum(p, q).sum())) < 0.02


def test_speculation_needs_the_check_program_and_matching_models(models):
    target, draft, same = models
    with pytest.raises(ValueError, match=r"enable_speculative_decoder\(3\)"):
        SpeculativeGenerator(draft, target, 3)
    with pytest.raises(ValueError, match="must be an int >= 1"):
        SpeculativeGenerator(draft, target, 0)
    with pytest.raises(ValueError, match="shorter than sequence_length"):
        SpeculativeGenerator(draft, target, 4).sample([PROMPTS[0]], sequence_length=3)
