"""The compiled programs themselves: caches updated in place, named parameters, buckets."""
from __future__ import annotations

import math
import re

import pytest

from decoders import LlamaForSampling
from decoders.programs.buckets import context_buckets, pick, token_buckets
from decoders.programs.keys import Block, ModelStep


@pytest.fixture(scope="module", params=[(1, False), (2, False), (1, True), (2, True)],
                ids=["batch1-per_block", "batch2-per_block", "batch1-whole_model", "batch2-whole_model"])
def model(tiny_llama, request):
    from decoders import NeuronConfig

    _, path = tiny_llama("gqa_tied_llama3", "safetensors")
    batch_size, whole = request.param
    return LlamaForSampling.from_pretrained(path, batch_size=batch_size, n_positions=256,
                                            context_length_estimate=[16, 64],
                                            neuron_config=NeuronConfig(whole_model_program=whole)).to_neuron()


def cache_copies(hlo_text: str, cache_elements: int, opcode: str = "copy") -> list[str]:
    """Lines of an optimized module that copy (or, with `opcode`, otherwise make) a whole KV
    cache's worth of values (any shape of that many elements)."""
    lines = []
    for line in hlo_text.splitlines():
        found = re.search(rf"= [a-z0-9]+\[([0-9,]*)\](\{{[^}}]*\}})? {opcode}\(", line)
        if (found and found.group(1)
                and math.prod(int(n) for n in found.group(1).split(",")) == cache_elements):
            lines.append(line.strip())
    return lines


def cache_rewrites(hlo_text: str, cache_dims: tuple[int, ...]) -> list[str]:
    """Fusions of an optimized module that write a whole cache other than in place: of the
    cache's shape, their fused computation's root is not the dynamic-update-slice (XLA:CPU
    writes such a fusion's whole output, e.g. a bitcast-convert of the updated cache)."""
    roots = dict(re.findall(r"^%?([\w.\-]+) [^\n]*\{\n(?:[^\n]*\n)*?\s+ROOT [^=]+= [^ ]+ ([a-z\-]+)\(",
                            hlo_text, re.M))
    shape = ",".join(str(n) for n in cache_dims)
    return [line.strip() for line in hlo_text.splitlines()
            if re.search(rf"= [a-z0-9]+\[{shape}\](\{{[^}}]*\}})? fusion\(", line)
            and roots[re.search(r"calls=%?([\w.\-]+)", line).group(1)] != "dynamic-update-slice"]


def test_no_compiled_step_copies_a_kv_cache(model):
    steps = [c for key, c in model.programs.compiled.items() if isinstance(key, (Block, ModelStep))]
    assert len(steps) == len(model.context_buckets) + len(model.decode_buckets())
    for compiled in steps:
        text = compiled.executable.hlo_text()
        assert "dynamic-update-slice" in text
        dims = model.session.builder.cache_spec("k").dims
        assert cache_copies(text, math.prod(dims)) == [], compiled.program.name
        assert cache_rewrites(text, dims) == [], compiled.program.name


def test_caches_are_donated_and_updated_in_place(model):
    keys_before = list(model.kv_cache.keys)
    model.sample([[1, 2, 3]] * model.batch_size, sequence_length=6, top_k=1, eos_token_id=[])
    assert all(buffer.is_deleted() for buffer in keys_before)
    assert not any(buffer.is_deleted() for buffer in model.kv_cache.keys)


def test_block_parameters_are_named(model):
    program = model.programs.build(Block(1, 128))
    assert program.param_names[:6] == ["hidden", "positions", "slot", "pad", "cache_k", "cache_v"]
    assert list(program.module.host_program_shape.parameter_names) == program.param_names
    aliased = {e.parameter_number for e in program.module.input_output_alias.entries}
    assert aliased == {program.param_names.index("cache_k"), program.param_names.index("cache_v")}


def test_buckets_follow_transformers_neuronx():
    assert token_buckets(1024) == [128, 256, 512, 1024]
    assert token_buckets(100) == [100]
    assert token_buckets([512, 128]) == [128, 512]
    assert context_buckets([128, 256, 512, 1024]) == [64, 128, 256, 512]
    assert context_buckets([128, 256], 100) == [100]
    assert pick([128, 256], 129) == 256
    with pytest.raises(ValueError, match="exceeds the largest bucket 256"):
        pick([128, 256], 257)
    with pytest.raises(ValueError, match="exceeds n_positions"):
        context_buckets([128], [256])


@pytest.mark.cpu_only
def test_the_copy_check_catches_a_program_that_reads_the_cache_before_updating_it(model):
    """Reading the old cache after an in-place update forces XLA:CPU to copy it (DESIGN's trap).
    XLA:GPU schedules that read before the update and needs no copy (seen on an H100), so the
    trap is a fact of XLA:CPU; the check above runs on every platform."""
    from pyhlo import compile_py_func
    from pyhlo.ops.reductions import reduce_sum
    from pyhlo.ops.shape_ops import dynamic_update_slice

    def trap(scribe):
        cache = scribe.f32[2, 2, 256, 16].Parameter(parameter_number=0, parameter_name="cache_k")
        new = scribe.f32[2, 2, 1, 16].Parameter(parameter_number=1)
        updated = dynamic_update_slice(cache, new, [0, 0, 5, 0])
        old_total = reduce_sum(cache, [0, 1, 2, 3])
        new_total = reduce_sum(updated, [0, 1, 2, 3])
        updated.set_alias_to(cache, must=True)
        return [updated, old_total, new_total]

    executable = model.programs.backend.compile(compile_py_func(trap).SerializeToString())
    assert cache_copies(executable.hlo_text(), 2 * 2 * 256 * 16) != []


@pytest.mark.cpu_only
def test_the_rewrite_check_catches_an_update_of_a_bf16_cache_as_its_bits(model):
    """A bf16 cache updated as u16 and bitcast back: XLA:CPU fuses the update and the bitcast,
    and the fusion's root, the bitcast, writes the whole cache."""
    from pyhlo import compile_py_func
    from pyhlo.ops import elementwise as ew
    from pyhlo.ops.shape_ops import dynamic_update_slice

    def trap(scribe):
        cache = scribe.bf16[2, 2, 256, 16].Parameter(parameter_number=0, parameter_name="cache_k")
        new = scribe.bf16[2, 2, 1, 16].Parameter(parameter_number=1)
        slot = scribe.s32[()].Parameter(parameter_number=2)
        bits = dynamic_update_slice(ew.bitcast_convert(cache, "u16"), ew.bitcast_convert(new, "u16"),
                                    [0, 0, slot, 0])
        updated = ew.bitcast_convert(bits, "bf16")
        updated.set_alias_to(cache, must=True)
        return [updated, slot]

    executable = model.programs.backend.compile(compile_py_func(trap).SerializeToString())
    assert cache_rewrites(executable.hlo_text(), (2, 2, 256, 16)) != []


@pytest.mark.parametrize("amp, kv_cache_dtype", [("bf16", None), ("f32", "bf16")])
def test_a_bf16_cache_is_updated_in_place(tiny_llama, amp, kv_cache_dtype):
    """bf16 caches (a bf16 model's, or an f32 model's kv_cache_dtype="bf16"), lines at one slot
    and at their own (continuous batching): no program copies or converts a whole cache."""
    from decoders import NeuronConfig
    from decoders.config import ContinuousBatchingConfig

    _, path = tiny_llama("gqa_tied_llama3", "safetensors")
    for batching in (None, ContinuousBatchingConfig(batch_size_for_shared_caches=2)):
        config = NeuronConfig(kv_cache_dtype=kv_cache_dtype, continuous_batching=batching)
        model = LlamaForSampling.from_pretrained(path, amp=amp, batch_size=2, n_positions=128,
                                                 context_length_estimate=[16], neuron_config=config)
        model.to_neuron()
        assert model.kv_cache.dtype == "bf16"
        elements = math.prod(model.session.builder.cache_spec("k").dims)
        steps = [(key, compiled) for key, compiled in model.programs.compiled.items()
                 if isinstance(key, (Block, ModelStep))]
        assert any(key.n_tokens == 1 for key, _ in steps)
        for _, compiled in steps:
            text = compiled.executable.hlo_text()
            assert cache_copies(text, elements) == [], compiled.program.name
            # XLA:CPU's way of updating a bf16 cache in f32: converted whole, updated, converted back.
            assert cache_copies(text, elements, "convert") == [], compiled.program.name
            assert cache_rewrites(text, model.session.builder.cache_spec("k").dims) == [], \
                compiled.program.name
