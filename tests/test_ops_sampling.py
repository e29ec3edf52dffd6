"""On-device token selection: greedy, and sampling that matches HF's temperature/top-k/top-p warpers."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hlo_run import run_fn
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from pyhlo import compile_py_func
from pyhlo.ops import sampling
from pyhlo.ops.elementwise import constant

SETTINGS = settings(max_examples=10, deadline=None)


def hf_filtered_probs(logits: np.ndarray, top_k: int, top_p: float, temperature: float) -> np.ndarray:
    """The distribution HF's generate() samples from, for one line of logits."""
    scores = torch.from_numpy(logits.astype(np.float32))[None]
    scores = TemperatureLogitsWarper(temperature)(None, scores)
    scores = TopKLogitsWarper(top_k)(None, scores)
    scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, dim=-1)[0].double().numpy()


def sampler(batch: int, vocab: int, k_max: int):
    """A program: (logits, top_k, top_p, temperature, state) -> (tokens, new state)."""

    def program(scribe):
        logits = scribe.f32[batch, vocab].Parameter(parameter_number=0, name="logits")
        top_k = scribe.s32[batch].Parameter(parameter_number=1, name="top_k")
        top_p = scribe.f32[batch].Parameter(parameter_number=2, name="top_p")
        temperature = scribe.f32[batch].Parameter(parameter_number=3, name="temperature")
        state = scribe.u32[2, 2].Parameter(parameter_number=4, name="rng_state")
        return list(sampling.sample(logits, top_k, top_p, temperature, state, k_max))

    return program


def _settings(batch, top_k, top_p, temperature):
    return (np.full(batch, top_k, np.int32), np.full(batch, top_p, np.float32),
            np.full(batch, temperature, np.float32))


def test_uniform_from_bits_is_in_the_unit_interval():
    bits = np.array([0, 1, 511, 512, 2**31, 2**32 - 512, 2**32 - 1], np.uint32)
    bits = np.concatenate([bits, np.random.default_rng(0).integers(0, 2**32, 1000, dtype=np.uint32)])
    (u,) = run_fn(lambda scribe: sampling.uniform_from_bits(
        scribe.u32[bits.size].Parameter(parameter_number=0)), bits)
    assert u.dtype == np.float32
    assert u.min() >= 0.0 and u.max() < 1.0
    np.testing.assert_array_equal(u, (bits >> 9).astype(np.float64) / 2**23)
    assert u[0] == 0.0 and u[6] == 1.0 - 2**-23


def test_rng_uniform_is_reproducible_and_advances_its_state():
    def program(scribe):
        state = scribe.u32[2, 2].Parameter(parameter_number=0)
        first, state = sampling.rng_uniform(state, (50, 40))
        second, state = sampling.rng_uniform(state, (50, 40))
        return [first, second, state]

    seed = sampling.seed_state(7)
    first, second, state = run_fn(program, seed)
    again, _, state_again = run_fn(program, seed)
    np.testing.assert_array_equal(first, again)
    np.testing.assert_array_equal(state, state_again)
    assert state.dtype == np.uint32 and state.shape == (2, 2)
    assert not np.array_equal(state, seed)
    assert not np.array_equal(first, second)
    for u in (first, second):
        assert u.min() >= 0.0 and u.max() < 1.0
        assert abs(u.mean() - 0.5) < 0.02  # 2000 draws: the standard error is 0.0065
        counts = np.histogram(u, bins=10, range=(0, 1))[0]
        assert _chi_square_p(counts, np.full(10, 0.1)) > 1e-4


def test_rng_state_must_be_u32_2x2():
    with pytest.raises(ValueError, match=r"state must be u32\[2,2\], got u64\[2\]"):
        compile_py_func(lambda scribe: sampling.rng_uniform(scribe.u64[2].Parameter(parameter_number=0),
                                                            (3,))[0])


@SETTINGS
@given(batch=st.integers(1, 4), vocab=st.integers(1, 40), seed=st.integers(0, 2**32 - 1))
def test_greedy_is_numpy_argmax(batch, vocab, seed):
    # Small integer logits: ties are common and go to the smallest token id, as in numpy.
    logits = np.random.default_rng(seed).integers(-3, 3, (batch, vocab)).astype(np.float32)
    (tokens,) = run_fn(lambda scribe: sampling.greedy(scribe.f32[batch, vocab].Parameter(parameter_number=0)),
                       logits)
    assert tokens.dtype == np.int32
    np.testing.assert_array_equal(tokens, logits.argmax(-1))


@SETTINGS
@given(batch=st.integers(1, 4), vocab=st.integers(2, 30), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_top_k_one_is_greedy(batch, vocab, seed, data):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((batch, vocab)) * 3).astype(np.float32)
    k_max = data.draw(st.integers(1, vocab))
    top_p = rng.uniform(0.05, 1.0, batch).astype(np.float32)
    temperature = rng.uniform(0.1, 2.0, batch).astype(np.float32)
    tokens, _ = run_fn(sampler(batch, vocab, k_max), logits, np.ones(batch, np.int32), top_p, temperature,
                       sampling.seed_state(seed))
    np.testing.assert_array_equal(tokens, logits.argmax(-1))


def _filtered_probs_program(batch, vocab, k_max):
    def program(scribe):
        logits = scribe.f32[batch, vocab].Parameter(parameter_number=0)
        top_k = scribe.s32[batch].Parameter(parameter_number=1)
        top_p = scribe.f32[batch].Parameter(parameter_number=2)
        temperature = scribe.f32[batch].Parameter(parameter_number=3)
        return list(sampling.top_k_top_p_probs(logits, top_k, top_p, temperature, k_max))

    return program


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 4), vocab=st.integers(1, 30), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_filtered_distribution_matches_hf_warpers(batch, vocab, seed, data):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((batch, vocab)) * 2).astype(np.float32)
    k_max = data.draw(st.integers(1, vocab))
    top_k = rng.integers(1, k_max + 1, batch).astype(np.int32)
    top_p = rng.uniform(0.01, 1.0, batch).astype(np.float32)
    top_p[rng.random(batch) < 0.3] = 1.0
    temperature = rng.uniform(0.2, 3.0, batch).astype(np.float32)

    probs, ids = run_fn(_filtered_probs_program(batch, vocab, k_max), logits, top_k, top_p, temperature)
    for line in range(batch):
        ours = np.zeros(vocab)
        ours[ids[line]] = probs[line]
        expected = hf_filtered_probs(logits[line], int(top_k[line]), float(top_p[line]),
                                     float(temperature[line]))
        np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-7)


def test_top_k_keeps_ties_at_the_boundary_like_hf():
    logits = np.array([[3.0, 1.0, 2.0, 2.0, 0.0, 2.0]], np.float32)
    probs, ids = run_fn(_filtered_probs_program(1, 6, 6), logits, *_settings(1, 2, 1.0, 1.0))
    ours = np.zeros(6)
    ours[ids[0]] = probs[0]
    np.testing.assert_allclose(ours, hf_filtered_probs(logits[0], 2, 1.0, 1.0), rtol=1e-6)
    assert set(np.flatnonzero(ours)) == {0, 2, 3, 5}


def test_same_state_same_tokens_other_state_other_tokens():
    batch, vocab = 64, 16
    logits = np.zeros((batch, vocab), np.float32)  # uniform: every line is a fair 16-sided die
    program = sampler(batch, vocab, vocab)
    args = (logits, *_settings(batch, vocab, 1.0, 1.0))

    tokens, state = run_fn(program, *args, sampling.seed_state(1))
    again, state_again = run_fn(program, *args, sampling.seed_state(1))
    other, _ = run_fn(program, *args, sampling.seed_state(2))
    following, _ = run_fn(program, *args, state)

    np.testing.assert_array_equal(tokens, again)
    np.testing.assert_array_equal(state, state_again)
    assert not np.array_equal(tokens, other)
    assert not np.array_equal(tokens, following)
    assert len(set(tokens.tolist())) > 8


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), k_max=st.sampled_from([1, 5, 12, 50]))
def test_tokens_come_only_from_the_allowed_set(seed, k_max):
    batch, vocab = 16, 50
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((batch, vocab)) * 2).astype(np.float32)
    top_k = rng.integers(1, k_max + 1, batch).astype(np.int32)
    top_p = rng.uniform(0.05, 1.0, batch).astype(np.float32)
    temperature = rng.uniform(0.3, 2.0, batch).astype(np.float32)

    tokens, _ = run_fn(sampler(batch, vocab, k_max), logits, top_k, top_p, temperature,
                       sampling.seed_state(seed))
    for line, token in enumerate(tokens):
        allowed = hf_filtered_probs(logits[line], int(top_k[line]), float(top_p[line]),
                                    float(temperature[line]))
        assert allowed[token] > 0, (line, token)


def _chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of Pearson's chi-square test of `counts` against `probs` (all probs > 0)."""
    n = counts.sum()
    expected = n * probs
    statistic = float(((counts - expected) ** 2 / expected).sum())
    dof = len(probs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


@pytest.mark.parametrize("top_k, top_p, temperature", [
    (8, 1.0, 1.0),   # plain softmax sampling
    (5, 1.0, 0.7),   # top-k with temperature
    (8, 0.8, 1.0),   # top-p
    (6, 0.9, 1.5),   # all three
])
def test_draw_frequencies_follow_the_hf_distribution(top_k, top_p, temperature):
    batch, vocab = 6000, 8
    logits = np.array([2.0, 1.5, 1.2, 0.9, 0.4, 0.0, -0.5, -1.0], np.float32)
    expected = hf_filtered_probs(logits, top_k, top_p, temperature)

    tokens, _ = run_fn(sampler(batch, vocab, vocab), np.tile(logits, (batch, 1)),
                       *_settings(batch, top_k, top_p, temperature), sampling.seed_state(top_k * 100 + 7))
    counts = np.bincount(tokens, minlength=vocab)
    allowed = expected > 0
    assert counts[~allowed].sum() == 0, "a filtered-out token was drawn"
    assert _chi_square_p(counts[allowed], expected[allowed]) > 1e-4, (counts, expected * batch)


def test_k_max_must_fit_the_vocabulary():
    with pytest.raises(ValueError, match=r"k_max=9 must be in 1..8"):
        compile_py_func(sampler(2, 8, 9))


# -- over vocabulary blocks (tensor parallelism); on 4 replicas in tests/test_vocab_parallel.py ---------
ONE_REPLICA = [[0]]


@SETTINGS
@given(batch=st.integers(1, 4), n=st.integers(1, 12), seed=st.integers(0, 2**32 - 1))
def test_best_candidate_is_the_largest_ties_to_the_smallest_id(batch, n, seed):
    rng = np.random.default_rng(seed)
    values = rng.integers(-3, 3, (batch, n)).astype(np.float32)
    ids = np.stack([rng.permutation(100)[:n] for _ in range(batch)]).astype(np.int32)

    def program(scribe):
        return sampling.best_candidate(scribe.f32[batch, n].Parameter(parameter_number=0),
                                       scribe.s32[batch, n].Parameter(parameter_number=1))

    (best,) = run_fn(program, values, ids)
    expected = [ids[line][values[line] == values[line].max()].min() for line in range(batch)]
    np.testing.assert_array_equal(best, expected)


@SETTINGS
@given(batch=st.integers(1, 4), width=st.integers(1, 30), first=st.integers(0, 1000),
       seed=st.integers(0, 2**32 - 1))
def test_greedy_sharded_on_one_replica_is_greedy_from_its_first_id(batch, width, first, seed):
    logits = np.random.default_rng(seed).integers(-3, 3, (batch, width)).astype(np.float32)

    def program(scribe):
        logits = scribe.f32[batch, width].Parameter(parameter_number=0)
        return sampling.greedy_sharded(logits, constant(scribe, "s32", first), ONE_REPLICA)

    (tokens,) = run_fn(program, logits)
    np.testing.assert_array_equal(tokens, logits.argmax(-1) + first)


@SETTINGS
@given(batch=st.integers(1, 4), width=st.integers(2, 30), seed=st.integers(0, 2**32 - 1))
def test_gather_candidates_on_one_replica_keeps_values_and_ids(batch, width, seed):
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((batch, width)).astype(np.float32)
    values[0, 0] = -np.inf               # a masked padding logit survives the trip through its bits
    ids = rng.integers(0, 1 << 20, (batch, width)).astype(np.int32)

    def program(scribe):
        return list(sampling.gather_candidates(scribe.f32[batch, width].Parameter(parameter_number=0),
                                               scribe.s32[batch, width].Parameter(parameter_number=1),
                                               ONE_REPLICA))

    got_values, got_ids = run_fn(program, values, ids)
    np.testing.assert_array_equal(got_values, values)
    np.testing.assert_array_equal(got_ids, ids)


@SETTINGS
@given(batch=st.integers(1, 4), width=st.integers(2, 30), first=st.integers(0, 1000),
       seed=st.integers(0, 2**32 - 1), data=st.data())
def test_sample_sharded_on_one_replica_draws_sample_tokens_from_its_first_id(batch, width, first, seed, data):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((batch, width)) * 2).astype(np.float32)
    k_max = data.draw(st.integers(1, width))
    top_k = rng.integers(1, k_max + 1, batch).astype(np.int32)
    top_p = rng.uniform(0.05, 1.0, batch).astype(np.float32)
    temperature = rng.uniform(0.3, 2.0, batch).astype(np.float32)

    def program(scribe):
        logits = scribe.f32[batch, width].Parameter(parameter_number=0)
        top_k = scribe.s32[batch].Parameter(parameter_number=1)
        top_p = scribe.f32[batch].Parameter(parameter_number=2)
        temperature = scribe.f32[batch].Parameter(parameter_number=3)
        state = scribe.u32[2, 2].Parameter(parameter_number=4)
        return list(sampling.sample_sharded(logits, constant(scribe, "s32", first), top_k, top_p, temperature,
                                            state, k_max, ONE_REPLICA))

    args = (logits, top_k, top_p, temperature, sampling.seed_state(seed))
    tokens, state = run_fn(program, *args)
    expected, expected_state = run_fn(sampler(batch, width, k_max), *args)
    # The top k_max candidates first, then the draw: sample()'s token, shifted to this block's ids.
    np.testing.assert_array_equal(tokens, expected + first)
    np.testing.assert_array_equal(state, expected_state)
