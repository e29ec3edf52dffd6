"""Tensor parallelism on 4 CPU devices: tp_degree 1, 2 and 4 give the same greedy tokens and
logits for every family, and each device holds its share of the weights and caches.

XLA:CPU shows several devices only when XLA_FLAGS asks for them before jax starts, so the
models run in a fresh Python process that reports back as JSON.
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
# Bloom's tiny model has 6 heads (ALiBi slopes of a head count that is not a power of two):
# over 4 devices they are padded to 8.
# Over 3 devices the tiny Llama pads everything: 2 KV heads to 3, the MLP's 160 rows to 162, the
# vocabulary's 320 rows to 321.
# Gemma 2 and 3 (layers of two kinds, per-head q/k norms replicated) at tp 2.
DEGREES: dict = {"llama_gqa": (1, 2, 3, 4), "gemma2": (1, 2), "gemma3": (1, 2)}
VARIANTS = ["llama_mha", "llama_gqa", "gpt_neox", "bloom", "gpt2", "opt", "opt_post_norm", "gptj", "mistral",
            "qwen2", "mixtral", "qwen3", "qwen3_moe", "phi3", "phi3_longrope", "gemma2", "gemma3"]

RUN = textwrap.dedent("""
    import json, sys, tempfile, pathlib
    import numpy as np
    import torch
    from decoders import NeuronAutoModelForCausalLM, NeuronConfig
    from decoders.parallel.sharding import split_axis
    from pyhlo.dtypes import byte_size
    import tiny_families, tiny_llama

    def checkpoint(variant):
        directory = pathlib.Path(tempfile.mkdtemp())
        if variant.startswith("llama"):
            model = tiny_llama.make_model({"llama_mha": "mha", "llama_gqa": "gqa_tied_llama3"}[variant])
            return tiny_llama.save(model, directory, "safetensors")
        return tiny_families.save(tiny_families.make_model(variant), directory)

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 320, (n,), generator=gen).tolist() for n in (9, 20)]
    results = {}
    DEGREES = json.loads(sys.argv[2])
    for variant in sys.argv[1].split(","):
        path = checkpoint(variant)
        runs = {}
        for tp in DEGREES.get(variant, (1, 2, 4)):
            model = NeuronAutoModelForCausalLM.from_pretrained(
                path, batch_size=2, n_positions=128, context_length_estimate=[16, 32],
                tp_degree=tp).to_neuron()
            tokens, scores = model.sample(prompts, sequence_length=60, top_k=1, eos_token_id=[],
                                          output_scores=True)
            builder = model.session.builder
            layer = builder.layer_params()
            declared = ([(p, builder.decoder.n_layers) for p in layer]
                        + [(p, 1) for p in builder.shared_params()])

            def size(spec):
                return int(np.prod(spec.dims)) * byte_size(spec.dtype)

            runs[tp] = {"tokens": tokens.tolist(), "scores": [s.tolist() for s in scores],
                        "device_bytes": model.session.device_bytes(),
                        "declared_weight_bytes": sum(size(builder.spec(p)) * n for p, n in declared),
                        "sharded_weight_bytes": sum(size(builder.spec(p)) * n for p, n in declared
                                                    if split_axis(p) is not None),
                        "cache_bytes": model.kv_cache.byte_size // tp}
        results[variant] = runs
    print(json.dumps(results))
""")


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, PYTHONPATH=python_path(str(TESTS.parent), str(TESTS)),
               XLA_FLAGS="--xla_force_host_platform_device_count=4", PYHLO_PLATFORM="cpu")
    done = subprocess.run([sys.executable, "-c", RUN, ",".join(VARIANTS), json.dumps(DEGREES)], env=env,
                          capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("variant", VARIANTS)
def test_tp_2_and_4_give_the_tokens_and_logits_of_tp_1(results, variant):
    import numpy as np

    runs = results[variant]
    for tp in sorted(runs)[1:]:
        assert runs[tp]["tokens"] == runs["1"]["tokens"], tp
        for step, (ours, reference) in enumerate(zip(runs[tp]["scores"], runs["1"]["scores"])):
            ours, reference = np.asarray(ours), np.asarray(reference)
            # Sums split over devices add up in another order: f32 rounding only.
            assert np.abs(ours - reference).max() / np.abs(reference).max() < 1e-5, (tp, step)


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_device_holds_its_share_of_weights_and_caches(results, variant):
    runs = results[variant]
    for tp in runs:
        run = runs[tp]
        # The device buffers hold exactly what the declarations give one device.
        assert run["device_bytes"] == [run["declared_weight_bytes"] + run["cache_bytes"]] * int(tp), tp
    # 2 KV heads are replicated over 4 devices, Bloom's 6 heads padded to 8: not an even split.
    uneven = {"llama_gqa": ("3", "4"), "mistral": ("4",), "qwen2": ("4",), "mixtral": ("4",), "bloom": ("4",),
              "qwen3": ("4",), "qwen3_moe": ("4",), "phi3": ("4",), "phi3_longrope": ("4",)}
    for tp in sorted(runs)[1:]:
        if tp not in uneven.get(variant, ()):
            assert runs[tp]["sharded_weight_bytes"] * int(tp) == runs["1"]["sharded_weight_bytes"], tp
            assert runs[tp]["cache_bytes"] * int(tp) == runs["1"]["cache_bytes"], tp


def test_rows_that_do_not_split_are_padded_with_zero_rows():
    from decoders.blocks.params import Kind, Param, Shard, Source
    from decoders.parallel import sharding

    # gate | up, 5 rows each, over 2 devices: 3 rows of each part a device, the last one padding.
    gate_up = Param("mlp.gate_up.weight", Kind.LINEAR, (10, 4), Shard.COLUMN, Source(("w",)), segments=(5, 5))
    assert ([sharding.indices(gate_up, 2, r).tolist() for r in range(2)]
            == [[0, 1, 2, 5, 6, 7], [3, 4, -1, 8, 9, -1]])
    weight = np.arange(40, dtype=np.float32).reshape(10, 4)
    part = sharding.shard(gate_up, weight, 2, 1)
    assert (part.shape == (6, 4) and (part[[2, 5]] == 0).all()
            and (part[[0, 1, 3, 4]] == weight[[3, 4, 8, 9]]).all())


@pytest.mark.parametrize("heads, kv_heads, tp, device_heads, device_kv_heads", [
    (4, 2, 4, 1, 1),      # KV heads replicated
    (9, 3, 2, 6, 2),      # SmolLM2 over 2: 3 KV heads padded to 4, query heads to 12
    (9, 3, 4, 3, 1),
    (6, 6, 4, 2, 2),      # multi-head, padded to 8
    (8, 8, 4, 2, 2),
])
def test_each_device_gets_whole_kv_groups(heads, kv_heads, tp, device_heads, device_kv_heads):
    from decoders.blocks import Attention

    attention = Attention(out="o", q="q", k="k", v="v", hidden=heads * 4, n_heads=heads, n_kv_heads=kv_heads,
                          head_dim=4)
    device = attention.sharded(tp)
    assert (device.n_heads, device.n_kv_heads) == (device_heads, device_kv_heads)


SMOLLM2 = textwrap.dedent("""
    import json, sys
    from decoders import LlamaForSampling
    tokens = {}
    for tp in (1, 2):
        model = LlamaForSampling.from_pretrained(sys.argv[1], n_positions=128, context_length_estimate=[32],
                                                 tp_degree=tp).to_neuron()
        ids = model.tokenizer("The three primary colors are")["input_ids"]
        out = model.sample([ids], sequence_length=len(ids) + 16, top_k=1, eos_token_id=[])
        tokens[tp] = out[0].tolist()
        heads = model.session.builder.device_decoder.layer.attention
        tokens[f"heads{tp}"] = [heads.n_heads, heads.n_kv_heads]
    print(json.dumps(tokens))
""")


def test_smollm2_over_two_devices_pads_its_heads_and_keeps_its_tokens(smollm2_gguf):
    env = dict(os.environ, PYTHONPATH=python_path(TESTS.parent),
               XLA_FLAGS="--xla_force_host_platform_device_count=2",
               PYHLO_PLATFORM="cpu")
    done = subprocess.run([sys.executable, "-c", SMOLLM2, str(smollm2_gguf)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["1"] == result["2"]
    # 9 query heads in 3 KV groups: 3 groups padded to 4, so 6 query and 2 KV heads a device.
    assert result["heads1"] == [9, 3] and result["heads2"] == [6, 2]


@pytest.mark.parametrize("heads, kv_heads, tp, strategy, device_heads, device_kv_heads", [
    (4, 2, 2, "SHARD_OVER_HEADS", 2, 1),
    (8, 4, 2, "SHARD_OVER_HEADS", 4, 2),
    (4, 2, 4, "REPLICATED_HEADS", 1, 1),     # KV heads replicated, as None chooses
    (9, 3, 2, "REPLICATED_HEADS", 6, 2),     # padded to 4 KV heads, as None chooses
    (4, 2, 1, "SHARD_OVER_BATCH", 4, 2),     # one device holds all heads: any strategy
    (4, 2, 1, "ALL_GATHER_HEADS", 4, 2),
])
def test_each_gqa_strategy_gives_each_device_its_heads(heads, kv_heads, tp, strategy, device_heads,
                                                        device_kv_heads):
    from decoders import GQA
    from decoders.blocks import Attention
    from decoders.parallel.kv_sharding import decide

    attention = Attention(out="o", q="q", k="k", v="v", hidden=heads * 4, n_heads=heads, n_kv_heads=kv_heads,
                          head_dim=4)
    device = attention.sharded(tp, decide(attention, tp, GQA[strategy]))
    assert (device.n_heads, device.n_kv_heads) == (device_heads, device_kv_heads)


def test_gqa_strategies_that_do_not_fit_name_the_ones_that_work():
    from decoders import GQA
    from decoders.blocks import Attention
    from decoders.parallel.kv_sharding import decide

    def attention(heads, kv_heads):
        return Attention(out="o", q="q", k="k", v="v", hidden=heads * 4, n_heads=heads, n_kv_heads=kv_heads,
                         head_dim=4)

    with pytest.raises(ValueError, match=r"SHARD_OVER_HEADS .* 2 KV heads .* tp_degree 4 does not divide "
                                         r"them.*REPLICATED_HEADS \(or None\) works: 1 query and 1 KV heads "
                                         r"a device, the 2 KV heads replicated"):
        decide(attention(4, 2), 4, GQA.SHARD_OVER_HEADS)
    with pytest.raises(ValueError, match=r"REPLICATED_HEADS \(or None\) works: 6 query and 2 KV heads a "
                                         r"device, the 3 KV heads padded to 4"):
        decide(attention(9, 3), 2, GQA.SHARD_OVER_HEADS)


GQA_RUN = textwrap.dedent("""
    import json, sys
    from decoders import GQA, LlamaForSampling, NeuronConfig
    results = {}
    for tp, strategy in ((1, None), (2, "shard-over-heads"), (4, GQA.REPLICATED_HEADS),
                         (4, GQA.SHARD_OVER_HEADS)):
        config = NeuronConfig(group_query_attention=strategy)
        name = f"{tp} {config.group_query_attention}"
        try:
            model = LlamaForSampling.from_pretrained(sys.argv[1], batch_size=1, n_positions=64,
                                                     context_length_estimate=[16], tp_degree=tp,
                                                     neuron_config=config).to_neuron()
        except ValueError as error:
            results[name] = str(error)
            continue
        out = model.sample([[5, 6, 7, 8, 9]], sequence_length=24, top_k=1, eos_token_id=[])
        heads = model.session.builder.device_decoder.layer.attention
        results[name] = [out[0].tolist(), heads.n_heads, heads.n_kv_heads]
    print(json.dumps(results))
""")


def test_gqa_strategies_over_devices_keep_the_tokens(tiny_llama):
    _, path = tiny_llama("gqa_tied_llama3", "safetensors")       # 4 heads, 2 KV heads
    env = dict(os.environ, PYTHONPATH=python_path(TESTS.parent),
               XLA_FLAGS="--xla_force_host_platform_device_count=4",
               PYHLO_PLATFORM="cpu")
    done = subprocess.run([sys.executable, "-c", GQA_RUN, str(path)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    tokens, _, _ = result["1 None"]
    assert result["2 GQA.SHARD_OVER_HEADS"] == [tokens, 2, 1]
    assert result["4 GQA.REPLICATED_HEADS"] == [tokens, 1, 1]
    assert "tp_degree 4 does not divide them" in result["4 GQA.SHARD_OVER_HEADS"]
    assert "REPLICATED_HEADS (or None) works" in result["4 GQA.SHARD_OVER_HEADS"]
