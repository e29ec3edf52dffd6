"""KV caches in a type of their own (NeuronConfig.kv_cache_dtype): an f32 model with bf16 caches
holds HF's keys and values rounded to bf16, computes what the f32 caches do up to that
rounding, with the CPU kernels and without, and the setting is checked, saved and asked for
on the command line."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_kv_cache_quant import PROMPTS, SHAPE, assert_within_rounding, teacher_forced_logits

from decoders import LlamaForSampling, NeuronConfig


def test_the_cache_holds_hf_keys_and_values_in_bf16(tiny_llama):
    hf, path = tiny_llama("gqa_tied_llama3", "safetensors")
    model = LlamaForSampling.from_pretrained(path, neuron_config=NeuronConfig(kv_cache_dtype="bf16"), **SHAPE)
    model.to_neuron()
    model.forward(torch.tensor(PROMPTS))
    config = hf.config
    cache = model.kv_cache
    assert cache.dtype == "bf16"
    head_dim = config.hidden_size // config.num_attention_heads
    # 2 lines, K and V, 64 slots, 2 bytes a value: half the f32 caches' bytes.
    values = 2 * config.num_hidden_layers * 2 * config.num_key_value_heads * 64 * head_dim
    assert cache.byte_size == values * 2
    with torch.no_grad():
        past = hf(torch.tensor(PROMPTS), use_cache=True).past_key_values
    n = len(PROMPTS[0])
    # Layer 0's keys and values are HF's rounded to bf16 (to within one bf16 step: the two
    # implementations' f32 values may round to neighbours).
    for ours, theirs in ((cache.keys[0], past.layers[0].keys), (cache.values[0], past.layers[0].values)):
        stored = cache.as_values(np.asarray(ours))[:, :, :n].astype(np.float32)
        expected = theirs.numpy()
        assert (np.abs(stored - expected) <= np.abs(expected) * 2.0 ** -7 + 1e-6).all()


@pytest.mark.parametrize("kernels", [None, False])
def test_bf16_caches_compute_what_f32_caches_do_up_to_their_rounding(tiny_llama, kernels):
    _, path = tiny_llama("gqa_tied_llama3", "safetensors")
    runs = {}
    for dtype in ("bf16", None):
        config = NeuronConfig(kv_cache_dtype=dtype, cpu_kernels=kernels)
        model = LlamaForSampling.from_pretrained(path, neuron_config=config, **SHAPE).to_neuron()
        assert model.kv_cache.dtype == (dtype or "f32")
        runs[dtype] = teacher_forced_logits(model, steps=30)
    assert_within_rounding(runs["bf16"], runs[None], 1e-2)


@pytest.mark.cpu_only
def test_the_decode_kernel_and_plain_xla_read_bf16_caches_alike(tiny_llama):
    _, path = tiny_llama("gqa_tied_llama3", "safetensors")
    runs = {}
    for kernels in (True, False):
        config = NeuronConfig(kv_cache_dtype="bf16", cpu_kernels=kernels)
        model = LlamaForSampling.from_pretrained(path, neuron_config=config, **SHAPE).to_neuron()
        runs[kernels] = teacher_forced_logits(model, steps=20)
        tokens = model.sample(PROMPTS, sequence_length=50, top_k=1, eos_token_id=[])
        runs[("tokens", kernels)] = tokens.tolist()
    np.testing.assert_allclose(runs[True], runs[False], rtol=0, atol=1e-4 * np.abs(runs[False]).max())
    assert runs[("tokens", True)] == runs[("tokens", False)]


def test_kv_cache_dtype_settings():
    assert NeuronConfig(kv_cache_dtype="bf16").kv_cache_dtype == "bf16"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of None, 'f32', 'bf16', got 'fp8'"):
        NeuronConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype and kv_cache_quant both set"):
        NeuronConfig(kv_cache_dtype="bf16", kv_cache_quant=True)
    assert NeuronConfig.from_dict(NeuronConfig(kv_cache_dtype="bf16").to_dict()).kv_cache_dtype == "bf16"


def test_a_bf16_model_asked_for_f32_caches_keeps_them_f32(tiny_llama):
    _, path = tiny_llama("gqa_tied_llama3", "safetensors")
    config = NeuronConfig(kv_cache_dtype="f32")
    model = LlamaForSampling.from_pretrained(path, amp="bf16", neuron_config=config, **SHAPE).to_neuron()
    assert model.kv_cache.dtype == "f32"
    tokens = model.sample(PROMPTS, sequence_length=30, top_k=1, eos_token_id=[])
    assert tokens.shape == (2, 30)


def test_the_command_line_asks_for_the_cache_type():
    import argparse

    from tools.model_options import add_model_arguments, weight_options

    parser = argparse.ArgumentParser()
    add_model_arguments(parser.add_argument_group("model"))
    assert weight_options(parser.parse_args(["--kv-cache-dtype", "bf16"]))["kv_cache_dtype"] == "bf16"
    assert weight_options(parser.parse_args([]))["kv_cache_dtype"] is None
