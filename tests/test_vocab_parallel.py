"""The vocabulary-parallel LM head: under tensor parallelism each replica keeps its block of the
logits, and the greedy and sampler programs gather each replica's best candidates, never the
logits. Tokens, scores and the sampling distribution are those of one device.

XLA:CPU shows several devices only when XLA_FLAGS asks for them before jax starts, so the
programs run in a fresh Python process that reports back as JSON.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from child_env import python_path

TESTS = Path(__file__).resolve().parent
VOCAB = 321         # over 2 devices 161 rows each, over 4 devices 81: the last rows are padding
DEGREES = (1, 2, 4)


def _run(script: str, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=python_path(str(TESTS.parent), str(TESTS)),
               XLA_FLAGS="--xla_force_host_platform_device_count=4", PYHLO_PLATFORM="cpu")
    done = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- the ops, on 4 replicas ------------------------------------------------------------------------
OPS = textwrap.dedent("""
    import json
    import numpy as np
    from pyhlo import compile_py_func
    from pyhlo.ops import elementwise as ew, sampling
    from pyhlo.ops.collectives import replica_id
    from runtime import get_backend

    backend = get_backend("xla", "cpu")
    B, W, TP, V = 64, 9, 4, 34              # 4 blocks of 9 columns, the last 2 columns padding
    GROUPS = [list(range(TP))]

    def first_id(scribe):
        return ew.multiply(ew.convert(replica_id(scribe), "s32"), W)

    def run(fn, per_replica, replicas):
        exe = backend.compile(compile_py_func(fn).SerializeToString(), num_replicas=replicas)
        inputs = [[backend.to_device(a, replica=r) for a in args] for r, args in enumerate(per_replica)]
        outputs = exe.run_replicated(inputs) if replicas > 1 else [exe.run(inputs[0])]
        return [[backend.to_host(o).tolist() for o in out] for out in outputs]

    def greedy(scribe):
        logits = scribe.f32[B, W].Parameter(parameter_number=0)
        return [sampling.greedy_sharded(logits, first_id(scribe), GROUPS)]

    def sampler(width, k_max, sharded):
        def program(scribe):
            logits = scribe.f32[B, width].Parameter(parameter_number=0)
            k = scribe.s32[B].Parameter(parameter_number=1)
            p = scribe.f32[B].Parameter(parameter_number=2)
            t = scribe.f32[B].Parameter(parameter_number=3)
            state = scribe.u32[2, 2].Parameter(parameter_number=4)
            if sharded:
                return list(sampling.sample_sharded(logits, first_id(scribe), k, p, t, state, k_max, GROUPS))
            return list(sampling.sample(logits, k, p, t, state, k_max))
        return program

    def blocks(logits):
        padded = np.full((B, W * TP), -np.inf, np.float32)
        padded[:, :V] = logits
        return [np.ascontiguousarray(padded[:, r * W:(r + 1) * W]) for r in range(TP)]

    rng = np.random.default_rng(0)
    results = {}
    # Small integers: ties within and across blocks, and many negative lines (padding never wins).
    ties = rng.integers(-6, 2, (B, V)).astype(np.float32)
    results["greedy"] = {"logits": ties.tolist(), "tokens": run(greedy, [[b] for b in blocks(ties)], TP)}

    logits = (rng.standard_normal((B, V)) * 2).astype(np.float32)
    settings = [rng.integers(1, 6, B).astype(np.int32), rng.uniform(0.3, 1.0, B).astype(np.float32),
                rng.uniform(0.5, 1.5, B).astype(np.float32), sampling.seed_state(11)]
    for k_max in (1, 5, 8, W + 3, V):       # under, at and over a block's width
        one = run(sampler(V, k_max, False), [[logits, *settings]], 1)
        shards = run(sampler(W, k_max, True), [[b, *settings] for b in blocks(logits)], TP)
        results[f"sample{k_max}"] = {"one": one, "shards": shards}
    print(json.dumps(results))
""")


@pytest.fixture(scope="module")
def ops():
    return _run(OPS)


def test_greedy_over_vocabulary_blocks_is_numpy_argmax_on_every_replica(ops):
    logits = np.asarray(ops["greedy"]["logits"], np.float32)
    for (tokens,) in ops["greedy"]["tokens"]:
        # Ties go to the smallest token id, as np.argmax over the whole vocabulary.
        np.testing.assert_array_equal(tokens, logits.argmax(-1))


@pytest.mark.parametrize("k_max", [1, 5, 8, 12, 34])
def test_sampling_over_vocabulary_blocks_draws_the_tokens_of_one_device(ops, k_max):
    run = ops[f"sample{k_max}"]
    (tokens, state), = run["one"]
    # The global top k_max is among the blocks' top k_max: the same candidates by rank, the same
    # state, so the same draw; every replica draws it and advances the state alike.
    assert run["shards"] == [[tokens, state]] * 4


# -- a model whose vocabulary does not divide -----------------------------------------------------
MODEL = textwrap.dedent("""
    import json, sys, tempfile, pathlib
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from decoders import NeuronAutoModelForCausalLM
    from decoders.programs.keys import Greedy, LMHead
    import tiny_llama

    vocab, degrees = int(sys.argv[1]), json.loads(sys.argv[2])
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False)
    path = pathlib.Path(tempfile.mkdtemp())
    tiny_llama.as_reference(LlamaForCausalLM(config)).save_pretrained(path)

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in (9, 20)]
    common = dict(sequence_length=48, eos_token_id=[])

    def all_gathers(program):
        return [list(i.shape.dimensions) for c in program.module.computations for i in c.instructions
                if i.opcode == "all-gather"]

    runs = {}
    for tp in degrees:
        model = NeuronAutoModelForCausalLM.from_pretrained(
            path, batch_size=2, n_positions=128, context_length_estimate=[16, 32], tp_degree=tp).to_neuron()
        greedy, scores = model.sample(prompts, top_k=1, output_scores=True, **common)
        banned = model.sample(prompts, top_k=1, no_repeat_ngram_size=2, **common)
        sampled = model.sample(prompts, top_k=5, top_p=0.9, temperature=0.8, seed=7, **common)
        forward = model.forward(torch.tensor([prompts[1][:12], prompts[0] + prompts[1][:3]]))
        session = model.session
        logits = session.run_batch(np.array([prompts[1][:16], prompts[0] + prompts[1][:7]], np.int32), 0,
                                   np.zeros(2, np.int32))
        sampler = session.sampler(session.sampler_k_max or 64)
        runs[tp] = {"greedy": greedy.tolist(), "scores": [s.tolist() for s in scores],
                    "banned": banned.tolist(),
                    "sampled": sampled.tolist(), "forward": forward.tolist(),
                    "replica_logits": [list(session.placement.host(logits, r).shape) for r in range(tp)],
                    "last_block": session.placement.host(logits, tp - 1).tolist(),
                    "vocab_shard": session.builder.vocab_shard,
                    "gathers": {"greedy": all_gathers(session.programs.get(Greedy()).program),
                                "sampler": all_gathers(sampler.program),
                                "lm_head": all_gathers(session.programs.get(LMHead(16)).program)}}
    print(json.dumps(runs))
""")


@pytest.fixture(scope="module")
def runs():
    return _run(MODEL, str(VOCAB), json.dumps(DEGREES))


@pytest.mark.parametrize("tp", DEGREES[1:])
def test_greedy_tokens_and_scores_over_an_uneven_vocabulary_are_those_of_one_device(runs, tp):
    ours, reference = runs[str(tp)], runs["1"]
    assert ours["greedy"] == reference["greedy"]
    assert ours["banned"] == reference["banned"]          # n-gram bans put back split on the replicas
    for step, (scores, expected) in enumerate(zip(ours["scores"], reference["scores"])):
        scores, expected = np.asarray(scores), np.asarray(expected)
        # Every real token, no padding column.
        assert scores.shape == expected.shape == (2, VOCAB), step
        # Sums split over devices add up in another order: f32 rounding only.
        assert np.abs(scores - expected).max() / np.abs(expected).max() < 1e-5, step
    forward, expected = np.asarray(ours["forward"]), np.asarray(reference["forward"])
    assert forward.shape == (2, VOCAB)
    assert np.abs(forward - expected).max() / np.abs(expected).max() < 1e-5


@pytest.mark.parametrize("tp", DEGREES[1:])
def test_sampling_with_a_seed_draws_the_tokens_of_one_device(runs, tp):
    # The draw over the gathered candidates is the one device's draw over the whole vocabulary
    # (test_sampling_over_vocabulary_blocks_draws_the_tokens_of_one_device); the logits differ by
    # f32 rounding only, far from moving a draw across a boundary of the cumulative distribution.
    assert runs[str(tp)]["sampled"] == runs["1"]["sampled"]
    assert runs["1"]["sampled"] != runs["1"]["greedy"]


@pytest.mark.parametrize("tp", DEGREES[1:])
def test_each_replica_keeps_its_block_of_logits_and_gathers_only_candidates(runs, tp):
    run = runs[str(tp)]
    width = -(-VOCAB // tp)
    assert run["vocab_shard"] == width
    assert run["replica_logits"] == [[2, width]] * tp
    # The padding rows' logits (zero rows: logit 0) are masked: never chosen, however negative the rest.
    padding = np.asarray(run["last_block"])[:, VOCAB - (tp - 1) * width:]
    assert padding.shape == (2, width * tp - VOCAB) and (padding == -np.inf).all()
    gathers = run["gathers"]
    assert gathers["lm_head"] == []
    # One all-gather: each replica's best logit beside its token id.
    assert gathers["greedy"] == [[2, 2 * tp]]
    # Each replica's top 64 logits beside their ids (not [2, vocab], whatever the vocabulary's size).
    assert gathers["sampler"] == [[2, 2 * 64 * tp]]


def test_one_device_gathers_nothing(runs):
    assert runs["1"]["replica_logits"] == [[2, VOCAB]]
    assert runs["1"]["gathers"] == {"greedy": [], "sampler": [], "lm_head": []}
