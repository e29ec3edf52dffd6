"""What pyhlo builds for a platform other than XLA:CPU, checked here on XLA:CPU.

The GPU lowering's programs (weights [out, in] as the checkpoint stores them, the LM head in
the amp type, one decode program, attention without a conditional) are plain HLO, so XLA:CPU
runs them too: their tokens and logits are held to HF's model here. What only a GPU can show
(speed, XLA:GPU's own passes) is measured by `pyhlo bench --device cuda`.
"""
from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_llama_golden import hf_greedy, relative_error

from decoders import LlamaForSampling, NeuronConfig
from decoders.blocks.params import Kind
from decoders.lowering import XlaLowering
from decoders.platform_choice import choose_lowering
from decoders.programs.compiled import compile_workers
from decoders.programs.keys import Block, LMHead, ModelStep
from runtime import pjrt

CUDA = SimpleNamespace(platform="cuda")


def _build(path, amp="f32", batch_size=1, **config):
    return LlamaForSampling.from_pretrained(path, batch_size=batch_size, n_positions=256, amp=amp,
                                            context_length_estimate=[16, 64],
                                            neuron_config=NeuronConfig(**config)).to_neuron()


def _hlo(model, key) -> str:
    return pjrt.hlo_text(model.programs.get(key).program.module.SerializeToString())


def test_the_gpu_lowering():
    lowering = choose_lowering(NeuronConfig(), CUDA, "bf16", 1)
    assert type(lowering) is XlaLowering
    assert lowering.weight_layout == "out_in"          # as the checkpoint stores it: no transpose at load
    assert lowering.head_dtype == "bf16"               # the LM head reads bf16, not an f32 copy
    assert lowering.whole_model_decode is True
    assert lowering.attention_in_conditional is False
    assert lowering.f32_dot_precision == "highest"
    chosen = choose_lowering(NeuronConfig(whole_model_program=False, weight_layout="in_out",
                                          f32_matmul_precision="tf32"), CUDA, "f32", 8)
    assert ((chosen.whole_model_decode, chosen.weight_layout, chosen.f32_dot_precision)
            == (False, "in_out", "default"))
    with pytest.raises(ValueError, match="cpu_kernels=True"):
        choose_lowering(NeuronConfig(cpu_kernels=True), CUDA, "f32", 1)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_gpu_programs_match_hf(tiny_llama, as_if_on, batch_size):
    as_if_on("cuda")
    hf, path = tiny_llama("gqa_tied_llama3", "safetensors")
    model = _build(path, batch_size=batch_size)
    assert model.lowering.attention_in_conditional is False and model.lowering.whole_model_decode
    prompt = torch.randint(0, 320, (1, 40), generator=torch.Generator().manual_seed(11))
    length = 150                                       # decode crosses the 128 -> 256 token bucket
    expected, expected_logits = hf_greedy(hf, prompt, length)
    tokens, logits = model.sample([prompt[0].tolist()] * batch_size, sequence_length=length, top_k=1,
                                  eos_token_id=[], output_scores=True)
    for line in range(batch_size):
        assert tokens[line].tolist() == expected[0].tolist()
    for step in range(21):
        assert relative_error(logits[step][0], expected_logits[step][0]) < 1e-4, step
    for key in (ModelStep(1, 128), Block(16, 16)):
        text = _hlo(model, key)
        assert " conditional(" not in text, key
        assert "operand_precision={highest,highest}" in text, key


def test_gpu_weights_are_placed_as_stored(tiny_llama, as_if_on):
    """[out, in] as torch stores a Linear: arrange() hands the checkpoint's array on untouched."""
    as_if_on("cuda")
    _, path = tiny_llama("mha", "safetensors")
    model = _build(path)
    lowering, builder = model.lowering, model.session.builder
    linear = next(p for p in builder.layer_params() if p.kind is Kind.LINEAR)
    stored = np.arange(np.prod(linear.shape), dtype=np.float32).reshape(linear.shape)
    arranged = lowering.arrange(linear, stored)
    assert arranged.shape == stored.shape and np.shares_memory(arranged, stored)


def test_bf16_gpu_programs_stay_close_to_hf(tiny_llama, as_if_on):
    as_if_on("cuda")
    hf, path = tiny_llama("gqa_tied_llama3", "safetensors")
    model = _build(path, amp="bf16")
    head = _hlo(model, LMHead(16))
    assert "bf16[" in head.split("ENTRY")[1].split("\n")[1]          # the head's weight is a bf16 parameter
    prompt = torch.randint(0, 320, (1, 12), generator=torch.Generator().manual_seed(6))
    _, expected_logits = hf_greedy(hf, prompt, 20)
    _, logits = model.sample(prompt, sequence_length=20, top_k=1, eos_token_id=[], output_scores=True)
    assert relative_error(logits[0][0], expected_logits[0][0]) < 3e-2


def test_f32_products_are_exact_unless_tf32_is_asked_for(tiny_llama):
    _, path = tiny_llama("mha", "safetensors")
    exact = _hlo(_build(path, cpu_kernels=False), Block(16, 16))
    loose = _hlo(_build(path, cpu_kernels=False, f32_matmul_precision="tf32"), Block(16, 16))
    dots = [line for line in exact.splitlines() if " dot(" in line]
    assert dots and all("operand_precision={highest,highest}" in line for line in dots)
    assert " dot(" in loose and "operand_precision" not in loose
    with pytest.raises(ValueError, match="f32_matmul_precision"):
        NeuronConfig(f32_matmul_precision="fast")


def test_bf16_dots_name_no_precision():
    from pyhlo import compile_py_func
    from pyhlo.ops.linalg import matmul

    def program(scribe):
        return matmul(scribe.bf16[2, 3].Parameter(parameter_number=0),
                      scribe.bf16[3, 4].Parameter(parameter_number=1), out_dtype="f32")

    assert "operand_precision" not in pjrt.hlo_text(compile_py_func(program).SerializeToString())


def test_conversions_round_as_written_off_cpu():
    """Off XLA:CPU pyhlo compiles with xla_allow_excess_precision=false, so an f32 -> bf16 ->
    f32 pair still rounds (XLA:GPU drops the pair otherwise). The same options on XLA:CPU's
    compiler show that they are taken and keep the rounding."""
    from pyhlo import compile_py_func
    from pyhlo.ops import elementwise as ew

    def program(scribe):
        return ew.convert(ew.convert(scribe.f32[4].Parameter(parameter_number=0), "bf16"), "f32")

    assert ("xla_allow_excess_precision", False) in pjrt.compile_overrides("cuda")
    assert pjrt.compile_overrides("cpu") == ()
    module = compile_py_func(program).SerializeToString()
    device = pjrt.devices("cpu")[0]
    options = pjrt._compile_options(1, [device.id], "cuda")
    executable = pjrt.get_client("cpu").compile_and_load(pjrt._jax.mlir.hlo_to_stablehlo(module),
                                                         pjrt.xc.DeviceList((device,)), options)
    x = np.array([1.0001, 2.0003, 3.1, 1 / 3], np.float32)
    (out,) = pjrt.execute(executable, [pjrt.to_device(x, device)])
    import ml_dtypes

    assert np.array_equal(np.asarray(out), x.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_the_compile_options_are_part_of_the_cache_key():
    from runtime import get_backend

    assert "options" in get_backend().cache_key_parts()


def test_compiles_run_one_at_a_time_where_parallel_compiles_crash(caplog):
    assert pjrt.parallel_compiles_safe("cpu") and not pjrt.parallel_compiles_safe("cuda")
    serial = SimpleNamespace(platform="cuda", parallel_compiles_safe=False)
    with caplog.at_level(logging.WARNING, logger="pyhlo"):
        assert compile_workers(serial, None) == 1
        assert compile_workers(serial, 4) == 1
    assert "one program at a time" in caplog.text
    assert compile_workers(SimpleNamespace(platform="cpu", parallel_compiles_safe=True), None) == 2
    assert compile_workers(SimpleNamespace(platform="cpu", parallel_compiles_safe=True), 3) == 3


@pytest.mark.parametrize("kernels", [pytest.param(True, marks=pytest.mark.cpu_only), False],
                         ids=["cpu_kernels", "xla_dot"])
def test_decode_steps_upload_no_step_state(tiny_llama, monkeypatch, kernels):
    """The whole-model decode program hands the next step its positions and slot: after the
    prefill, sample() copies nothing from the host per token (token ids stay on the device)."""
    hf, path = tiny_llama("mha", "safetensors")
    model = _build(path, batch_size=2, cpu_kernels=kernels, whole_model_program=True)
    prompt = torch.randint(0, 320, (2, 10), generator=torch.Generator().manual_seed(3))
    placement = model.session.placement
    uploads = []
    real_put = placement.put
    monkeypatch.setattr(placement, "put", lambda array: uploads.append(np.shape(array)) or real_put(array))
    tokens = model.sample(prompt, sequence_length=140, top_k=1, eos_token_id=[])
    # The prompt chunk, the pads, the first step's inputs: a few copies for 130 new tokens.
    assert len(uploads) <= 8, uploads
    expected, _ = hf_greedy(hf, prompt[:1], 140)
    assert torch.equal(tokens[:1], expected)
