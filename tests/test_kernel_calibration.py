"""The kernel-or-XLA choice per weight type is measured on the machine, kept, and obeyed."""
from __future__ import annotations

import json

import pytest

from decoders import kernel_calibration
from runtime import cpu_kernels
from runtime.select import get_backend


def test_kernel_rows_parse_and_refuse_bad_settings():
    assert kernel_calibration.parse("f32=4, bf16=0,s8=2-8,blocks=2") == {"f32": (1, 4), "bf16": (0, 0),
                                                                     "s8": (2, 8), "blocks": (1, 2)}
    with pytest.raises(ValueError, match="TYPE=ROWS"):
        kernel_calibration.parse("f32=4-2,bf16=4,s8=8,blocks=8")
    with pytest.raises(ValueError, match="TYPE=ROWS"):
        kernel_calibration.parse("f32=0-2,bf16=4,s8=8,blocks=8")
    with pytest.raises(ValueError, match="must name every weight type"):
        kernel_calibration.parse("f32=4")
    with pytest.raises(ValueError, match="TYPE=ROWS"):
        kernel_calibration.parse("f32=four,bf16=4,s8=8,blocks=8")
    with pytest.raises(ValueError, match="TYPE=ROWS"):
        kernel_calibration.parse("f16=4,bf16=4,s8=8,blocks=8")


def test_the_kernel_rows_are_an_unbroken_run_of_kernel_wins():
    from_ = kernel_calibration.range_from
    assert from_({1: (1.0, 2.0), 2: (1.0, 2.0), 4: (3.0, 2.0), 8: (1.0, 2.0)}) == (1, 2)
    # XLA's dot wins at one row, the kernel from two on (an AVX-512 host, f32: 150 vs 136 us
    # at one row, 164 vs 207 at four).
    assert from_({1: (150.0, 136.0), 2: (157.0, 206.0), 4: (164.0, 207.0), 8: (244.0, 265.0)}) == (2, 8)
    assert from_({1: (1.0, 2.0), 8: (1.0, 2.0)}) == (1, 8)
    assert from_({1: (1.0, 2.0), 2: (1.97, 2.0)}) == (1, 1)        # a near tie is XLA's
    assert from_({1: (1.0, 2.0), 2: (1.97, 2.0), 4: (1.0, 2.0)}) == (1, 4)      # nor does it end the range
    assert from_({1: (1.0, 1.01), 2: (1.0, 1.02)}) == (0, 0)
    assert from_({1: (2.0, 1.0), 2: (2.0, 1.0)}) == (0, 0)
    assert kernel_calibration.format_table({"f32": (2, 8), "s8": (0, 0)}) == "f32 rows 2-8, s8 none"


@pytest.mark.cpu_only
def test_measurement_times_both_paths_for_every_weight_type():
    assert cpu_kernels.register()
    timings = kernel_calibration.measure(get_backend(), shape=(64, 64), chain_bytes=1 << 15, rows=(1, 3),
                                         repeats=1)
    assert set(timings) == set(kernel_calibration.TYPES)
    for by_rows in timings.values():
        assert set(by_rows) == {1, 3}
        assert all(kernel > 0 and xla > 0 for kernel, xla in by_rows.values())


def test_timed_runs_read_weights_that_left_the_caches():
    assert kernel_calibration.last_level_cache_bytes() >= 0
    # A 480 MB cache and 48 MB chains: 21 copies in turn read 1 GB between two runs of one copy.
    assert kernel_calibration.copies_for(48 << 20, 480 << 20) == 21
    assert kernel_calibration.copies_for(48 << 20, 32 << 20) == 3
    assert kernel_calibration.copies_for(48 << 20, 0) == 2
    assert kernel_calibration.copies_for(1 << 15, 1 << 40) == kernel_calibration.MAX_COPIES


def test_a_table_kept_under_an_older_rule_is_measured_again(monkeypatch, tmp_path):
    monkeypatch.delenv(kernel_calibration.ENV, raising=False)
    monkeypatch.setattr(cpu_kernels, "build", lambda: tmp_path / "libpyhlo_kernels-x.so")
    old = {kind: {"1": [1.0, 2.0]} for kind in kernel_calibration.TYPES}
    (tmp_path / "libpyhlo_kernels-x.paths.json").write_text(json.dumps({"microseconds": old}))
    fresh = {kind: {r: (2.0, 1.0) for r in kernel_calibration.ROWS} for kind in kernel_calibration.TYPES}
    monkeypatch.setattr(kernel_calibration, "measure", lambda backend: fresh)
    assert kernel_calibration.kernel_rows(None) == {kind: (0, 0) for kind in kernel_calibration.TYPES}
    kept = json.loads((tmp_path / "libpyhlo_kernels-x.paths.json").read_text())
    assert kept["rule"] == kernel_calibration.RULE


def test_the_table_is_measured_once_and_then_read(monkeypatch, tmp_path):
    monkeypatch.delenv(kernel_calibration.ENV, raising=False)
    monkeypatch.setattr(cpu_kernels, "build", lambda: tmp_path / "libpyhlo_kernels-x.so")
    fake = {kind: {1: (1.0, 2.0), 2: (1.0, 2.0), 4: (3.0, 2.0), 8: (1.0, 2.0)}
            for kind in kernel_calibration.TYPES}
    fake["f32"] = {r: (2.0, 1.0) for r in kernel_calibration.ROWS}
    monkeypatch.setattr(kernel_calibration, "measure", lambda backend: fake)
    table = kernel_calibration.kernel_rows(None)
    assert table == {"f32": (0, 0), "bf16": (1, 2), "s8": (1, 2), "blocks": (1, 2)}
    kept = json.loads((tmp_path / "libpyhlo_kernels-x.paths.json").read_text())
    assert {k: tuple(v) for k, v in kept["kernel_rows"].items()} == table
    assert kept["microseconds"]["f32"]["1"] == [2.0, 1.0]

    def measure_again(backend):
        raise AssertionError("measured twice")

    monkeypatch.setattr(kernel_calibration, "measure", measure_again)
    assert kernel_calibration.kernel_rows(None) == table


@pytest.mark.cpu_only
def test_a_type_limited_to_zero_rows_takes_xla_dot(tiny_llama, monkeypatch):
    from decoders import LlamaForSampling
    from decoders.programs.keys import Block

    _, path = tiny_llama("gqa_tied_llama3", "safetensors")
    monkeypatch.setenv(kernel_calibration.ENV, "f32=0,bf16=4,s8=8,blocks=8")
    model = LlamaForSampling.from_pretrained(path, n_positions=128, context_length_estimate=[16])
    assert dict(model.lowering.kernel_rows)["f32"] == (0, 0)

    def targets(model):
        module = model.programs.build(Block(1, 128)).module
        return {i.custom_call_target for c in module.computations for i in c.instructions} - {""}

    # Attention and the rotary tables take their kernels whatever the products do.
    kernels_besides_products = {cpu_kernels.DECODE_ATTENTION_TARGET, cpu_kernels.ROTARY_COS_SIN_TARGET}
    assert targets(model) == kernels_besides_products
    monkeypatch.setenv(kernel_calibration.ENV, "f32=4,bf16=4,s8=8,blocks=8")
    model = LlamaForSampling.from_pretrained(path, n_positions=128, context_length_estimate=[16])
    assert targets(model) == kernels_besides_products | {cpu_kernels.MATVEC_TARGET}
    # A range from two rows: one line takes XLA's dot, two lines the kernel.
    monkeypatch.setenv(kernel_calibration.ENV, "f32=2-8,bf16=4,s8=8,blocks=8")
    model = LlamaForSampling.from_pretrained(path, n_positions=128, context_length_estimate=[16])
    assert targets(model) == kernels_besides_products
    model = LlamaForSampling.from_pretrained(path, batch_size=2, n_positions=128,
                                             context_length_estimate=[16])
    assert targets(model) == kernels_besides_products | {cpu_kernels.MATVEC_TARGET}
