"""int8 per-channel weight quantization: the numpy quantizer, the same dequantization inside
an XLA program, and QuantizationConfig's checks."""
from __future__ import annotations

import numpy as np
import pytest
from child_env import python_path
from hlo_run import run_fn
from hypothesis import given, settings
from hypothesis import strategies as st

from decoders.config import QuantizationConfig
from decoders.weights.quantize import dequantize, quantize_per_channel
from pyhlo.ops import elementwise as ew
from pyhlo.ops.shape_ops import broadcast


@settings(max_examples=30, deadline=None)
@given(out=st.integers(1, 40), inner=st.integers(1, 70), seed=st.integers(0, 2**32 - 1),
       spread=st.sampled_from([1e-3, 1.0, 1e3]), zero_row=st.booleans())
def test_quantized_rows_round_to_the_nearest_step(out, inner, seed, spread, zero_row):
    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((out, inner)) * spread).astype(np.float32)
    if zero_row:
        weight[0] = 0
    q, scale = quantize_per_channel(weight)
    assert (q.dtype == np.int8 and scale.dtype == np.float32 and q.shape == weight.shape
            and scale.shape == (out,))
    # Reference in float64: the step is max |row| / 127, each value rounded to the nearest step.
    step = np.abs(weight.astype(np.float64)).max(axis=1) / 127
    expected = np.rint(weight / np.where(step > 0, step, 1)[:, None].astype(np.float32))
    np.testing.assert_array_equal(q, np.clip(expected, -127, 127))
    np.testing.assert_allclose(scale, step, rtol=1e-7)
    assert (np.abs(q).max(axis=1)[step > 0] == 127).all() and (q[step == 0] == 0).all()
    # Half a step, plus float32 rounding of the division and the product (a few ulps of the value).
    error = np.abs(dequantize(q, scale).astype(np.float64) - weight)
    assert (error <= scale[:, None] * 0.5 + np.abs(weight) * 2.0**-20 + 1e-30).all()


@settings(max_examples=15, deadline=None)
@given(out=st.integers(1, 30), inner=st.integers(1, 50), seed=st.integers(0, 2**32 - 1))
def test_the_programs_dequantize_exactly_as_numpy(out, inner, seed):
    weight = np.random.default_rng(seed).standard_normal((out, inner)).astype(np.float32)
    q, scale = quantize_per_channel(weight)

    def program(scribe):
        stored = scribe.s8[q.shape].Parameter(parameter_number=0)
        scales = scribe.f32[out].Parameter(parameter_number=1)
        return ew.multiply(ew.convert(stored, "f32"), broadcast(scales, q.shape, [0]))

    (widened,) = run_fn(program, q, scale)
    np.testing.assert_array_equal(widened, dequantize(q, scale))


def test_bad_configurations_are_clear_errors():
    with pytest.raises(ValueError, match="quant_dtype must be one of"):
        QuantizationConfig(quant_dtype="s4")
    with pytest.raises(ValueError, match="quantize_method must be one of"):
        QuantizationConfig(quantize_method="per_tensor")
    with pytest.raises(ValueError, match="unknown amp"):
        QuantizationConfig(dequant_dtype="f64")
    with pytest.raises(ValueError, match="dequant_dtype='bf16' does not match amp='f32'"):
        QuantizationConfig(dequant_dtype="bfloat16").check_amp("f32")
    QuantizationConfig(dequant_dtype="f32").check_amp("f32")
    QuantizationConfig().check_amp("bf16")      # None: the amp type


def test_which_weights_are_quantized():
    config = QuantizationConfig(quantize_attn=False, no_quantize_list=["mlp.down.weight"])
    assert config.quantizes("mlp.gate_up.weight")
    assert not config.quantizes("mlp.down.weight") and not config.quantizes("attn.qkv.weight")
    assert QuantizationConfig().quantizes("attn.out.weight")


def _dequantized_ahead(model, conv1d: bool):
    """The HF model with every 2-D weight inside its layers replaced by what int8 per-channel
    quantization keeps of it (per output row; GPT-2's Conv1D stores [in, out])."""
    import torch

    with torch.no_grad():
        for name, weight in model.named_parameters():
            if weight.ndim != 2 or not any(f".{part}." in name for part in ("layers", "h")):
                continue
            logical = weight.T if conv1d else weight
            kept = torch.from_numpy(dequantize(*quantize_per_channel(logical.numpy())))
            weight.copy_(kept.T if conv1d else kept)
    return model


@pytest.mark.parametrize("variant", ["llama_gqa", "gpt2", "bloom"])
@pytest.mark.parametrize("kernels", [None, False])
def test_a_quantized_model_computes_what_its_dequantized_weights_do(tmp_path, variant, kernels):
    """int8 weights with scales (the kernel's product, or XLA's convert and dot) against the
    same model run in f32 with those weights dequantized ahead of time: the same function."""
    import tiny_families
    import tiny_llama

    from decoders import NeuronAutoModelForCausalLM, NeuronConfig

    def checkpoint(directory, dequantize_first):
        model = (tiny_llama.make_model("gqa_tied_llama3") if variant == "llama_gqa"
                 else tiny_families.make_model(variant))
        if dequantize_first:
            model = _dequantized_ahead(model, conv1d=variant == "gpt2")
        if variant == "llama_gqa":
            return tiny_llama.save(model, directory, "safetensors")
        return tiny_families.save(model, directory)

    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15]]
    runs = {}
    for quantized in (True, False):
        path = checkpoint(tmp_path / str(quantized), dequantize_first=not quantized)
        config = NeuronConfig(quant=QuantizationConfig() if quantized else None, cpu_kernels=kernels)
        model = NeuronAutoModelForCausalLM.from_pretrained(path, batch_size=2, n_positions=64,
                                                           context_length_estimate=[16], neuron_config=config)
        model.to_neuron()
        runs[quantized] = model.sample(prompts, sequence_length=40, top_k=1, eos_token_id=[],
                                       output_scores=True)
        if quantized:
            builder = model.session.builder
            stored = {p.name: builder.spec(p).dtype for p in builder.layer_params()}
            assert stored["mlp.down.weight"] == "s8" and stored["mlp.down.weight.scale"] == "f32"
            assert all(dtype == "s8" for name, dtype in stored.items() if name.endswith(".weight")
                       and "norm" not in name)
    (tokens, scores), (expected_tokens, expected_scores) = runs[True], runs[False]
    assert tokens.tolist() == expected_tokens.tolist()
    scores, expected = np.stack(scores), np.stack(expected_scores)
    assert np.abs(scores - expected).max() / np.abs(expected).max() < 1e-5


def test_quantized_weights_save_and_load_as_int8(tmp_path, tiny_llama):
    import torch

    from decoders import LlamaForSampling, NeuronConfig
    from decoders.checkpoints.hf import _SafetensorsShard

    _, path = tiny_llama("gqa_tied_llama3", "safetensors")
    shape = dict(batch_size=1, n_positions=64, context_length_estimate=[16])
    quantized = NeuronConfig(quant=QuantizationConfig(quant_dtype="s8"))
    model = LlamaForSampling.from_pretrained(path, neuron_config=quantized, **shape).to_neuron()
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    expected = model.sample(prompt, sequence_length=30, top_k=1, eos_token_id=[])
    model.save(tmp_path, sharded_weights=True)
    stored = _SafetensorsShard(tmp_path / "weights" / "rank0.safetensors")
    assert stored.read("layer0/mlp.down.weight").dtype == np.int8
    assert stored.read("layer0/mlp.down.weight.scale").dtype == np.float32

    again = NeuronConfig(quant=QuantizationConfig(quant_dtype="s8"))
    loaded = LlamaForSampling.from_pretrained(path, neuron_config=again, **shape).load(tmp_path).to_neuron()
    assert loaded.programs.compiler_calls == 0
    assert torch.equal(loaded.sample(prompt, sequence_length=30, top_k=1, eos_token_id=[]), expected)
    with pytest.raises(ValueError, match="saved for quant="):
        LlamaForSampling.from_pretrained(path, **shape).load(tmp_path)


@pytest.mark.cpu_only
def test_int8_activations_run_an_int8_prompt_on_the_integer_gemm(tiny_llama):
    """NeuronConfig(quant=..., int8_activations=True): a prompt's products take the int8 GEMM
    (activations rounded per 32 values; where it has its fast form), decode steps the same
    matrix-vector kernel as without; the logits stay within the rounding's reach of the int8
    model with f32 activations and the greedy tokens agree."""
    import torch

    from decoders import LlamaForSampling, NeuronConfig
    from decoders.programs.keys import Block
    from runtime import cpu_kernels

    _, path = tiny_llama("gqa_tied_llama3", "safetensors")
    shape = dict(batch_size=1, n_positions=64, context_length_estimate=[16])
    runs = {}
    for rounded in (True, False):
        config = NeuronConfig(quant=QuantizationConfig(), cpu_kernels=True, int8_activations=rounded)
        model = LlamaForSampling.from_pretrained(path, neuron_config=config, **shape).to_neuron()
        prefill = model.programs.build(Block(16, 64)).module
        targets = {i.custom_call_target for c in prefill.computations for i in c.instructions}
        assert ("pyhlo_gemm_s8_x8" in targets) == (rounded and cpu_kernels.int8_gemm_is_fast())
        assert ("pyhlo_gemm_s8" in targets) == (not rounded and cpu_kernels.exact_gemm_is_fast())
        decode = model.programs.build(Block(1, 64)).module
        assert "pyhlo_matvec_s8" in {i.custom_call_target for c in decode.computations
                                     for i in c.instructions}
        runs[rounded] = model.sample(torch.arange(5, 17)[None], sequence_length=40, top_k=1, eos_token_id=[],
                                     output_scores=True)
    (tokens, scores), (expected_tokens, expected_scores) = runs[True], runs[False]
    scores, expected_scores = np.stack(scores), np.stack(expected_scores)
    for step in (0, 1):                                            # the prompt's token, a decode step
        expected = expected_scores[step]
        error = float(np.abs(scores[step] - expected).max() / np.abs(expected).max())
        assert (1e-7 < error < 3e-2) if cpu_kernels.int8_gemm_is_fast() else error < 1e-5, step
    assert tokens.tolist() == expected_tokens.tolist()


TP_RUN = """
import json, sys
import numpy as np
from decoders import LlamaForSampling, NeuronConfig, QuantizationConfig
runs = {}
for tp in (1, 2, 3):
    model = LlamaForSampling.from_pretrained(sys.argv[1], batch_size=2, n_positions=64,
                                             context_length_estimate=[16], tp_degree=tp,
                                             neuron_config=NeuronConfig(quant=QuantizationConfig()))
    tokens, scores = model.to_neuron().sample([[5, 6, 7, 8, 9, 10], [11, 12]], sequence_length=40, top_k=1,
                                              eos_token_id=[], output_scores=True)
    runs[tp] = {"tokens": tokens.tolist(), "scores": np.stack(scores).tolist()}
print(json.dumps(runs))
"""


def test_quantized_weights_split_over_devices_give_the_tokens_of_one(tiny_llama):
    """Scales follow their rows over devices (a row-split weight keeps all of them); over 3
    devices the MLP's padding rows are zero with zero scales."""
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
    for tp in ("2", "3"):
        assert runs[tp]["tokens"] == runs["1"]["tokens"]
        scores, expected = np.asarray(runs[tp]["scores"]), np.asarray(runs["1"]["scores"])
        assert np.abs(scores - expected).max() / np.abs(expected).max() < 1e-5
