"""Tensor parallelism's other ways of sharing out keys and values, on 4 CPU devices:
GQA.SHARD_OVER_BATCH (caches split by batch line), GQA.ALL_GATHER_HEADS (K and V split by
features, gathered) and flash decoding (shard_over_sequence: caches split by slot, partial
softmax statistics combined) give the greedy tokens and logits of tp_degree 1, and split
the caches as they say.

The runs generate past the 16 slots each of 4 devices holds (n_positions 64), so every
stretch of the flash-decoding cache is written and read, prefill chunks included.
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

# (variant, tp_degree, group_query_attention, shard_over_sequence, cpu_kernels)
RUNS = [
    ("llama_gqa", 2, "shard-over-batch", False, None),
    ("llama_gqa", 4, "shard-over-batch", False, None),
    ("llama_gqa", 2, "all-gather-heads", False, None),
    ("llama_gqa", 4, "all-gather-heads", False, None),     # 1 query head a device, inside a KV group
    ("llama_gqa", 2, None, True, None),
    ("llama_gqa", 4, None, True, None),
    ("llama_gqa", 4, "shard-over-batch", False, False),    # plain XLA: per-block programs
    ("llama_gqa", 4, None, True, False),
    ("bloom", 2, "shard-over-batch", False, None),          # ALiBi, fused per-head qkv
    ("bloom", 2, None, True, None),
    ("gpt2", 4, "all-gather-heads", False, None),           # fused [q | k | v] stored [in, out]
    ("mistral", 4, None, True, None),                       # sliding window over the stretches
]

RUN = textwrap.dedent("""
    import json, sys, tempfile, pathlib
    import numpy as np
    import torch
    from decoders import NeuronAutoModelForCausalLM, NeuronConfig
    import tiny_families, tiny_llama

    def checkpoint(variant):
        directory = pathlib.Path(tempfile.mkdtemp())
        if variant == "llama_gqa":
            return tiny_llama.save(tiny_llama.make_model("gqa_tied_llama3"), directory, "safetensors")
        return tiny_families.save(tiny_families.make_model(variant), directory)

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 320, (n,), generator=gen).tolist() for n in (9, 20, 3, 14)]
    runs = json.loads(sys.argv[1])
    paths, results = {}, {}
    variants = [(v, 1, None, False, None) for v in dict.fromkeys(r[0] for r in runs)]
    for variant, tp, gqa, over_sequence, kernels in variants + runs:
        if variant not in paths:
            paths[variant] = checkpoint(variant)
        config = NeuronConfig(group_query_attention=gqa, shard_over_sequence=over_sequence,
                              cpu_kernels=kernels)
        model = NeuronAutoModelForCausalLM.from_pretrained(
            paths[variant], batch_size=4, n_positions=64, context_length_estimate=[16, 32], tp_degree=tp,
            neuron_config=config).to_neuron()
        tokens, scores = model.sample(prompts, sequence_length=60, top_k=1, eos_token_id=[],
                                      output_scores=True)
        attention = model.session.builder.device_decoder.layer.attention
        results[json.dumps([variant, tp, gqa, over_sequence, kernels])] = {
            "tokens": tokens.tolist(), "scores": np.stack(scores).tolist(),
            "cache_dims": list(model.session.builder.cache_spec("cache").dims),
            "layout": attention.kv_sharding.value, "device_bytes": model.session.device_bytes()}
    print(json.dumps(results))
""")


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, PYTHONPATH=python_path(str(TESTS.parent), str(TESTS)),
               XLA_FLAGS="--xla_force_host_platform_device_count=4", PYHLO_PLATFORM="cpu")
    done = subprocess.run([sys.executable, "-c", RUN, json.dumps(RUNS)], env=env, capture_output=True,
                          text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _key(variant, tp, gqa=None, over_sequence=False, kernels=None):
    return json.dumps([variant, tp, gqa, over_sequence, kernels])


@pytest.mark.parametrize("run", RUNS, ids=lambda r: "-".join(map(str, r)))
def test_each_strategy_gives_the_tokens_and_logits_of_one_device(results, run):
    variant, tp, gqa, over_sequence, kernels = run
    ours, reference = results[_key(*run)], results[_key(variant, 1)]
    assert ours["tokens"] == reference["tokens"]
    scores, expected = np.asarray(ours["scores"]), np.asarray(reference["scores"])
    # Sums split over devices add up in another order: f32 rounding only.
    assert np.abs(scores - expected).max() / np.abs(expected).max() < 1e-5
    layout = "sequence" if over_sequence else {"shard-over-batch": "batch", "all-gather-heads": "gather"}[gqa]
    assert ours["layout"] == layout


@pytest.mark.parametrize("run", [r for r in RUNS if r[2] == "shard-over-batch" or r[3]],
                         ids=lambda r: "-".join(map(str, r)))
def test_the_caches_are_split_by_line_or_by_slot(results, run):
    variant, tp, gqa, over_sequence, _ = run
    lines, kv_heads, slots, head_dim = results[_key(variant, 1)]["cache_dims"]
    split = ([lines, kv_heads, slots // tp, head_dim] if over_sequence
             else [lines // tp, kv_heads, slots, head_dim])
    assert results[_key(*run)]["cache_dims"] == split
    assert len(set(results[_key(*run)]["device_bytes"])) == 1      # every device holds the same share


def test_strategies_that_do_not_fit_say_why_and_name_those_that_do():
    from decoders import GQA
    from decoders.blocks import Attention
    from decoders.parallel.kv_sharding import KVSharding, decide

    def attention(heads, kv_heads):
        return Attention(out="o", q="q", k="k", v="v", hidden=heads * 4, n_heads=heads, n_kv_heads=kv_heads,
                         head_dim=4)

    with pytest.raises(ValueError, match=r"GQA.SHARD_OVER_BATCH splits the 6 query heads evenly, and "
                                         r"tp_degree 4 does not divide them; REPLICATED_HEADS \(or None\) "
                                         r"works"):
        decide(attention(6, 6), 4, GQA.SHARD_OVER_BATCH)
    with pytest.raises(ValueError, match=r"GQA.ALL_GATHER_HEADS gives each device 3 query heads, which "
                                         r"neither hold whole groups of the 2 query heads .*SHARD_OVER_BATCH "
                                         r"works with a batch size that 4 divides"):
        decide(attention(12, 6), 4, GQA.ALL_GATHER_HEADS)
    with pytest.raises(ValueError, match=r"shard_over_sequence splits the caches by slot and cannot be "
                                         r"combined with GQA.SHARD_OVER_BATCH"):
        decide(attention(4, 2), 2, GQA.SHARD_OVER_BATCH, over_sequence=True)
    device = attention(4, 2).sharded(2, KVSharding.BATCH)
    with pytest.raises(ValueError, match="tp_degree 2 does not divide batch_size 3"):
        device.cache_dims(3, 64)
    device = attention(4, 2).sharded(4, KVSharding.SEQUENCE)
    with pytest.raises(ValueError, match="tp_degree 4 does not divide n_positions 66"):
        device.cache_dims(1, 66)
    assert device.cache_dims(2, 64) == (2, 2, 16, 4)


@pytest.mark.parametrize("kv_sharding, k_and_v_rows", [
    ("heads", lambda r: [8 + 2 * (r // 2), 9 + 2 * (r // 2), 12 + 2 * (r // 2),
                         13 + 2 * (r // 2)]),                               # its KV head
    ("batch", lambda r: list(range(8, 16))),                                # all of K and V
    ("gather", lambda r: [8 + r, 12 + r]),                                  # a quarter of each
])
def test_fused_qkv_rows_each_device_holds(kv_sharding, k_and_v_rows):
    """A fused [q | k | v] weight of 4 query heads and 2 KV heads, 2 features each, over 4
    devices: device r always holds query head r (rows 2r, 2r + 1); its keys and values depend
    on the split."""
    from decoders.blocks import Attention
    from decoders.parallel import sharding
    from decoders.parallel.kv_sharding import KVSharding

    attention = Attention(out="o", q="q", k="k", v="v", hidden=8, n_heads=4, n_kv_heads=2, head_dim=2)
    fused = attention.params("attn")[0]
    assert fused.segments == (8, 4, 4) and fused.kv_segments == (1, 2)
    for rank in range(4):
        held = sharding.indices(fused, 4, rank, KVSharding(kv_sharding))
        assert held.tolist() == [2 * rank, 2 * rank + 1, *k_and_v_rows(rank)]
