"""A model the machine cannot hold is refused before anything is built, in one line giving the
memory it would need (weights as placed + KV caches, from the declared parameters) and what
the machine has; the estimate is what loading then places."""
from __future__ import annotations

from types import SimpleNamespace

import psutil
import pytest

import decoders.programs.memory as memory
from decoders import LlamaForSampling, NeuronConfig, QuantizationConfig
from decoders.programs.compiled import ProgramSet
from decoders.programs.memory import ModelTooLarge, planned_memory
from runtime.kv_cache import KVCache


@pytest.fixture(scope="module")
def checkpoint(tiny_llama):
    return tiny_llama("gqa_tied_llama3", "safetensors")[1]


@pytest.fixture
def nothing_may_be_built(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("built before the memory check")

    monkeypatch.setattr(ProgramSet, "compile_all", boom)
    monkeypatch.setattr(ProgramSet, "build", boom)
    monkeypatch.setattr(KVCache, "__init__", boom)


def test_an_absurd_request_fails_before_anything_is_built(checkpoint, nothing_may_be_built):
    with pytest.raises(ModelTooLarge) as refused:
        LlamaForSampling.from_pretrained(checkpoint, batch_size=10_000, n_positions=10**6)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("this model needs ") and "KV caches" in message
    assert f"available of {memory.gib(psutil.virtual_memory().total)} RAM" in message
    assert isinstance(refused.value, ValueError)         # bad input, as the command line reports it


def test_the_machines_free_memory_is_the_bound(checkpoint, monkeypatch, nothing_may_be_built):
    model = LlamaForSampling.from_pretrained(checkpoint, n_positions=256, context_length_estimate=[16])
    need = planned_memory(model.session.builder).total_bytes
    machine = SimpleNamespace(available=need - 1, total=4 * need)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: machine)
    with pytest.raises(ModelTooLarge, match=f"needs {memory.gib(need)} .* has {memory.gib(need - 1)} "
                                            f"available of {memory.gib(4 * need)} RAM: use a smaller"):
        LlamaForSampling.from_pretrained(checkpoint, n_positions=256, context_length_estimate=[16])
    machine.available = need
    LlamaForSampling.from_pretrained(checkpoint, n_positions=256, context_length_estimate=[16])


INT8 = NeuronConfig(quant=QuantizationConfig(quant_dtype="s8"))


@pytest.mark.parametrize("settings", [dict(amp="f32"), dict(amp="bf16", neuron_config=INT8)],
                         ids=["f32", "bf16-int8"])
def test_the_estimate_is_what_loading_places(checkpoint, settings):
    model = LlamaForSampling.from_pretrained(checkpoint, batch_size=2, n_positions=128,
                                             context_length_estimate=[16], **settings)
    planned = planned_memory(model.session.builder)
    model.to_neuron()
    assert model.session.device_bytes() == [planned.total_bytes]
    assert model.kv_cache.byte_size == planned.kv_cache_bytes


def test_a_gpu_is_bounded_by_its_free_memory_where_pjrt_reports_it():
    planned = memory.PlannedMemory(n_layers=2, layer_weight_bytes=3 << 30, shared_weight_bytes=1 << 30,
                                   kv_cache_bytes=2 << 30)          # 9 GiB

    def gpu(limit, in_use):
        device = SimpleNamespace(memory_stats=lambda: {"bytes_limit": limit, "bytes_in_use": in_use})
        return SimpleNamespace(platform="cuda", local_devices=[device])

    with pytest.raises(ModelTooLarge, match="needs 9.0 GiB on each device .* cuda device has 8.0 GiB free"):
        memory.check_fits(planned, replicas=1, backend=gpu(10 << 30, 2 << 30))
    memory.check_fits(planned, replicas=1, backend=gpu(12 << 30, 2 << 30))
    memory.check_fits(planned, replicas=1, backend=gpu(0, 0))      # nothing reported: no check
