"""Quantized KV caches (NeuronConfig.kv_cache_quant): each slot's key and value of each KV head
kept as int8 values with an f32 scale. The caches hold HF's own keys and values, quantized;
the model computes what the unquantized one does up to that rounding; the CPU kernel and
plain XLA agree; tensor parallelism splits the packed rows like any cache."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from child_env import python_path

from decoders import LlamaForSampling, NeuronAutoModelForCausalLM, NeuronConfig

SHAPE = dict(batch_size=2, n_positions=64, context_length_estimate=[16])
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [14, 15, 16, 17, 18, 19, 20, 21, 22]]


def unpack(cache: np.ndarray) -> np.ndarray:
    """Packed int8 rows [..., d + 4] as f32 [..., d]."""
    values, scale = cache[..., :-4].astype(np.float32), np.ascontiguousarray(cache[..., -4:]).view(np.float32)
    return values * scale


def teacher_forced_logits(model, steps: int) -> np.ndarray:
    """Logits of the prompts' prefill, then of `steps` decode steps fed fixed tokens."""
    logits = [model.forward(torch.tensor(PROMPTS)).numpy()]
    for step in range(steps):
        position = len(PROMPTS[0]) + step
        fed = torch.tensor([[30 + step], [60 + step]])
        logits.append(model.forward(fed, cache_ids=torch.tensor([position])).numpy())
    return np.stack(logits)


def test_the_cache_holds_hf_keys_and_values_quantized(tiny_llama):
    hf, path = tiny_llama("gqa_tied_llama3", "safetensors")
    model = LlamaForSampling.from_pretrained(path, neuron_config=NeuronConfig(kv_cache_quant=True), **SHAPE)
    model.to_neuron()
    model.forward(torch.tensor(PROMPTS))
    config = hf.config
    head_dim = config.hidden_size // config.num_attention_heads
    cache = model.kv_cache
    assert cache.dtype == "s8" and cache.dims == (2, config.num_key_value_heads, 64, head_dim + 4)
    assert cache.byte_size == (2 * config.num_hidden_layers * 2 * config.num_key_value_heads * 64
                               * (head_dim + 4))
    with torch.no_grad():
        past = hf(torch.tensor(PROMPTS), use_cache=True).past_key_values
    n = len(PROMPTS[0])
    # Layer 0's keys and values are HF's exactly, quantized (later layers read quantized
    # caches below them, so theirs differ from HF's by that rounding).
    for ours, theirs in ((cache.keys[0], past.layers[0].keys), (cache.values[0], past.layers[0].values)):
        stored, expected = np.asarray(ours), theirs.numpy()
        scale = np.ascontiguousarray(stored[:, :, :n, -4:]).view(np.float32)
        np.testing.assert_allclose(scale[..., 0], np.abs(expected).max(axis=-1) / 127, rtol=1e-5)
        # Within half a step of HF's value (plus the two implementations' f32 differences).
        error = np.abs(unpack(stored[:, :, :n]) - expected)
        assert (error <= scale * 0.5 + 1e-5).all()
    for layer in range(config.num_hidden_layers):
        for ours in (cache.keys[layer], cache.values[layer]):
            # The prefill bucket (16 slots) is written whole; its padding is masked, the rest untouched.
            assert not np.asarray(ours)[:, :, 16:].any(), "slots past the prefill bucket stay empty"


@pytest.mark.parametrize("kernels", [None, False])
def test_a_quantized_cache_computes_what_the_plain_cache_does_up_to_its_rounding(tiny_llama, kernels):
    _, path = tiny_llama("gqa_tied_llama3", "safetensors")
    runs = {}
    for quant in (True, False):
        config = NeuronConfig(kv_cache_quant=quant, cpu_kernels=kernels)
        model = LlamaForSampling.from_pretrained(path, neuron_config=config, **SHAPE).to_neuron()
        runs[quant] = teacher_forced_logits(model, steps=30)
    assert_within_rounding(runs[True], runs[False], 2e-2)


def assert_within_rounding(rounded: np.ndarray, plain: np.ndarray, bound: float) -> None:
    """Logits of rounded caches differ from the plain caches' (some, by less than `bound` of
    their spread) and choose the same greedy token wherever the plain caches' top two are
    further apart than that difference."""
    spread = np.abs(plain).max()
    error = np.abs(rounded - plain).max()
    assert 0 < error < bound * spread, (error, spread)
    top2 = np.sort(plain, axis=-1)[..., -2:]
    clear = top2[..., 1] - top2[..., 0] > 2 * error
    assert clear.mean() > 0.5
    assert (rounded.argmax(-1) == plain.argmax(-1))[clear].all()


@pytest.mark.cpu_only
def test_the_decode_kernel_and_plain_xla_read_the_quantized_cache_alike(tiny_llama):
    _, path = tiny_llama("gqa_tied_llama3", "safetensors")
    runs = {}
    for kernels in (True, False):
        config = NeuronConfig(kv_cache_quant=True, cpu_kernels=kernels)
        model = LlamaForSampling.from_pretrained(path, neuron_config=config, **SHAPE).to_neuron()
        runs[kernels] = teacher_forced_logits(model, steps=20)
        tokens = model.sample(PROMPTS, sequence_length=50, top_k=1, eos_token_id=[])
        runs[("tokens", kernels)] = tokens.tolist()
    np.testing.assert_allclose(runs[True], runs[False], rtol=0, atol=1e-4 * np.abs(runs[False]).max())
    assert runs[("tokens", True)] == runs[("tokens", False)]


def test_other_families_and_sliding_windows_take_the_quantized_cache(family_checkpoint):
    """ALiBi (Bloom, the generic attention with a bias) and a GPT-NeoX block."""
    for variant in ("bloom", "gpt_neox"):
        _, path = family_checkpoint(variant)
        runs = {}
        for quant in (True, False):
            model = NeuronAutoModelForCausalLM.from_pretrained(
                path, neuron_config=NeuronConfig(kv_cache_quant=quant), **SHAPE).to_neuron()
            runs[quant] = teacher_forced_logits(model, steps=10)
        error, spread = np.abs(runs[True] - runs[False]).max(), np.abs(runs[False]).max()
        assert 0 < error < 2e-2 * spread, (variant, error, spread)


def test_kv_cache_quant_settings():
    assert NeuronConfig(kv_cache_quant="s8").kv_cache_quant is True
    with pytest.raises(ValueError, match="kv_cache_quant must be False, True or 's8'"):
        NeuronConfig(kv_cache_quant="fp8")
    assert NeuronConfig.from_dict(NeuronConfig(kv_cache_quant=True).to_dict()).kv_cache_quant is True


TP_RUN = """
import json, sys
import numpy as np
from decoders import LlamaForSampling, NeuronConfig
runs = {}
for name, tp, over_sequence in (("1", 1, False), ("2", 2, False), ("2-sequence", 2, True)):
    config = NeuronConfig(kv_cache_quant=True, shard_over_sequence=over_sequence)
    model = LlamaForSampling.from_pretrained(sys.argv[1], batch_size=2, n_positions=64,
                                             context_length_estimate=[16],
                                             tp_degree=tp, neuron_config=config)
    tokens, scores = model.to_neuron().sample([[5, 6, 7, 8, 9, 10], [11, 12]], sequence_length=40, top_k=1,
                                              eos_token_id=[], output_scores=True)
    runs[name] = {"tokens": tokens.tolist(), "scores": np.stack(scores).tolist()}
print(json.dumps(runs))
"""


def test_quantized_caches_split_over_devices_give_the_tokens_of_one(tiny_llama):
    """By KV heads, and by slots (flash decoding): each row keeps its own scale."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    _, path = tiny_llama("gqa_tied_llama3", "safetensors")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=python_path(root), XLA_FLAGS="--xla_force_host_platform_device_count=4",
               PYHLO_PLATFORM="cpu")
    done = subprocess.run([sys.executable, "-c", TP_RUN, str(path)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    runs = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("2", "2-sequence"):
        assert runs[name]["tokens"] == runs["1"]["tokens"], name
        scores, expected = np.asarray(runs[name]["scores"]), np.asarray(runs["1"]["scores"])
        assert np.abs(scores - expected).max() / np.abs(expected).max() < 1e-4, name


def test_smollm2_with_a_quantized_cache_keeps_its_greedy_tokens(smollm2_gguf):
    """SmolLM2 (its Q4_1 file as stored), 3 prompts of 64 tokens, 64 new tokens each. Each line
    gives the tokens of the plain cache, or diverges where the plain cache's top two logits
    are closer than the two caches' logits differ at that step: a near-tie."""
    models = {quant: LlamaForSampling.from_pretrained(smollm2_gguf, batch_size=3, n_positions=256,
                                                      context_length_estimate=[64],
                                                      neuron_config=NeuronConfig(kv_cache_quant=quant)).to_neuron()
              for quant in (True, False)}
    tokenizer = models[True].tokenizer
    prompts = []
    for text in ("The history of the printing press begins", "def merge_sort(items):\n    \"\"\"Sort a list",
                 "Photosynthesis is the process by which plants"):
        ids = tokenizer(text)["input_ids"]
        while len(ids) < 64:
            ids = ids + tokenizer(" and so on, as the story goes,")["input_ids"]
        prompts.append(ids[:64])
    runs = {quant: model.sample(np.array(prompts), sequence_length=128, top_k=1, eos_token_id=[],
                                output_scores=True)
            for quant, model in models.items()}
    (tokens, scores), (expected, expected_scores) = runs[True], runs[False]
    assert models[True].kv_cache.byte_size * 3 < models[False].kv_cache.byte_size
    same_lines = 0
    for line in range(3):
        differ = np.nonzero(np.asarray(tokens[line]) != np.asarray(expected[line]))[0]
        if not len(differ):
            same_lines += 1
            continue
        step = int(differ[0]) - 64
        plain, quantized = np.asarray(expected_scores[step][line]), np.asarray(scores[step][line])
        gap = plain[expected[line][64 + step]] - plain[tokens[line][64 + step]]
        assert 0 <= gap <= 2 * np.abs(quantized - plain).max(), (line, step, gap)
    assert same_lines >= 2


def test_a_saved_model_with_a_quantized_cache_loads_without_compiling(tmp_path, tiny_llama):
    _, path = tiny_llama("gqa_tied_llama3", "safetensors")
    config = dict(neuron_config=NeuronConfig(kv_cache_quant=True), **SHAPE)
    model = LlamaForSampling.from_pretrained(path, **config).to_neuron()
    expected = model.sample(PROMPTS, sequence_length=40, top_k=1, eos_token_id=[])
    model.save(tmp_path)
    loaded = LlamaForSampling.from_pretrained(path, **config).load(tmp_path).to_neuron()
    assert loaded.programs.compiler_calls == 0 and loaded.kv_cache.dtype == "s8"
    assert torch.equal(loaded.sample(PROMPTS, sequence_length=40, top_k=1, eos_token_id=[]), expected)


def test_the_command_line_asks_for_a_quantized_cache():
    import argparse

    from tools.model_options import add_model_arguments, weight_options

    parser = argparse.ArgumentParser()
    add_model_arguments(parser.add_argument_group("model"))
    assert weight_options(parser.parse_args(["--kv-cache-quant"]))["kv_cache_quant"] is True
    assert weight_options(parser.parse_args([]))["kv_cache_quant"] is False
