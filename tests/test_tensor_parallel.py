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

import pytest

TESTS = Path(__file__).resolve().parent
# Bloom's tiny model has 6 heads (ALiBi slopes of a head count that is not a power of two):
# it splits over 2 devices, not 4.
DEGREES = {"bloom": (1, 2)}
VARIANTS = ["llama_mha", "llama_gqa", "gpt_neox", "bloom", "gpt2", "opt", "opt_post_norm", "gptj", "mistral",
            "qwen2", "mixtral"]

RUN = textwrap.dedent("""
    import json, sys, tempfile, pathlib
    import numpy as np
    import torch
    from decoders import NeuronAutoModelForCausalLM, NeuronConfig
    from decoders.sharding import split_axis
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
                path, batch_size=2, n_positions=128, context_length_estimate=[16, 32], tp_degree=tp).to_neuron()
            tokens, scores = model.sample(prompts, sequence_length=60, top_k=1, eos_token_id=[], output_scores=True)
            builder = model.session.builder
            layer = builder.layer_params()
            declared = [(p, builder.decoder.n_layers) for p in layer] + [(p, 1) for p in builder.shared_params()]

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
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]),
               XLA_FLAGS="--xla_force_host_platform_device_count=4")
    done = subprocess.run([sys.executable, "-c", RUN, ",".join(VARIANTS), json.dumps(DEGREES)], env=env, capture_output=True, text=True,
                          timeout=1500)
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
    if variant not in ("llama_gqa", "mistral", "qwen2", "mixtral"):      # 2 KV heads: replicated over 4 devices
        for tp in sorted(runs)[1:]:
            assert runs[tp]["sharded_weight_bytes"] * int(tp) == runs["1"]["sharded_weight_bytes"], tp
            assert runs[tp]["cache_bytes"] * int(tp) == runs["1"]["cache_bytes"], tp


def test_heads_that_do_not_split_are_a_clear_error(tiny_llama):
    from decoders import LlamaForSampling

    _, path = tiny_llama("gqa_tied_llama3", "safetensors")           # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match="4 attention heads cannot be split over tp_degree 3"):
        LlamaForSampling.from_pretrained(path, tp_degree=3)
