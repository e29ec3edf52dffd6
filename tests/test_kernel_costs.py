"""The work inside pyhlo's kernels, counted from the custom calls' shapes (runtime/kernel_costs.py):
each kernel written with the real op, its count checked against the same count done by hand."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyhlo import compile_py_func
from pyhlo.dtypes import numpy_dtype
from pyhlo.ops import linalg
from pyhlo.ops.attention import decode_attention_kernel
from runtime import cpu_kernels
from runtime.kernel_costs import COST_RULES, KernelCost, module_kernel_costs


def nbytes(dtype: str, *dims: int) -> int:
    return math.prod(dims) * np.dtype(numpy_dtype(dtype)).itemsize


def test_every_registered_kernel_is_counted():
    assert set(COST_RULES) == set(cpu_kernels.TARGETS)


# The decode's matrix-vector product (2 rows) and a prompt's bf16 GEMM (128 rows).
@pytest.mark.parametrize("kernel, target, rows", [
    (linalg.matvec_kernel, cpu_kernels.MATVEC_TARGET, 2),
    (linalg.gemm_bf16_kernel, cpu_kernels.GEMM_BF16_TARGET, 128)])
def test_rows_by_a_bf16_matrix(kernel, target, rows):
    def program(scribe):
        x = scribe.f32[rows, 576].Parameter(parameter_number=0)
        w = scribe.bf16[1536, 576].Parameter(parameter_number=1)
        return kernel(x, w)

    costs = module_kernel_costs(compile_py_func(program))
    assert costs.calls == {target: 1} and costs.uncounted == {}
    assert costs.total == KernelCost(flops=2 * rows * 576 * 1536,
                                     bytes_accessed=1536 * 576 * 2 + rows * 576 * 4 + rows * 1536 * 4)


@settings(max_examples=30, deadline=None)
@given(rows=st.lists(st.integers(1, 5), min_size=1, max_size=3), k=st.integers(1, 300), n=st.integers(1, 300),
       dtype=st.sampled_from(["f32", "bf16", "s8"]))
def test_matvec_kernel_counts(rows, k, n, dtype):
    quantized = dtype == "s8"

    def program(scribe):
        x = scribe.f32[(*rows, k)].Parameter(parameter_number=0)
        w = getattr(scribe, dtype)[n, k].Parameter(parameter_number=1)
        scale = scribe.f32[n].Parameter(parameter_number=2) if quantized else None
        return linalg.matvec_kernel(x, w, scale)

    costs = module_kernel_costs(compile_py_func(program))
    line_count = math.prod(rows)
    read = nbytes("f32", line_count, k) + nbytes(dtype, n, k) + (nbytes("f32", n) if quantized else 0)
    written = nbytes("f32", line_count, n)
    target = cpu_kernels.MATVEC_S8_TARGET if quantized else cpu_kernels.MATVEC_TARGET
    assert costs.calls == {target: 1}
    assert costs.total == KernelCost(flops=2 * line_count * k * n, bytes_accessed=read + written)


@settings(max_examples=30, deadline=None)
@given(line_count=st.integers(1, 8), blocks=st.integers(1, 12), n=st.integers(1, 200),
       form=st.sampled_from(["q8_0", "q4_0", "q4_1"]), int8_activations=st.booleans())
def test_block_matvec_kernel_counts(line_count, blocks, n, form, int8_activations):
    k = 32 * blocks
    values_dtype, values_k = ("s8", k) if form == "q8_0" else ("u8", k // 2)

    def program(scribe):
        x = scribe.f32[line_count, k].Parameter(parameter_number=0)
        values = getattr(scribe, values_dtype)[n, values_k].Parameter(parameter_number=1)
        scales = scribe.f16[n, blocks].Parameter(parameter_number=2)
        mins = scribe.f16[n, blocks].Parameter(parameter_number=3) if form == "q4_1" else None
        return linalg.matvec_blocks_kernel(x, values, scales, mins, int8_activations=int8_activations)

    costs = module_kernel_costs(compile_py_func(program))
    weights = nbytes(values_dtype, n, values_k) + nbytes("f16", n, blocks) * (2 if form == "q4_1" else 1)
    targets = cpu_kernels.MATVEC_BLOCK_X8_TARGETS if int8_activations else cpu_kernels.MATVEC_BLOCK_TARGETS
    assert costs.calls == {targets[form]: 1}
    assert costs.total == KernelCost(flops=2 * line_count * k * n,
                                     bytes_accessed=nbytes("f32", line_count, k) + weights
                                     + nbytes("f32", line_count, n))


@settings(max_examples=30, deadline=None)
@given(b=st.integers(1, 3), kv_heads=st.integers(1, 3), group=st.integers(1, 3), slots=st.integers(1, 300),
       d=st.sampled_from([8, 16, 64]), dtype=st.sampled_from(["f32", "bf16", "s8"]))
def test_decode_attention_kernel_counts_the_whole_cache(b, kv_heads, group, slots, d, dtype):
    h = kv_heads * group
    row = d + 4 if dtype == "s8" else d   # packed int8 rows carry their scale

    def program(scribe):
        q = scribe.f32[b, h, 1, d].Parameter(parameter_number=0)
        k = getattr(scribe, dtype)[b, kv_heads, slots, row].Parameter(parameter_number=1)
        v = getattr(scribe, dtype)[b, kv_heads, slots, row].Parameter(parameter_number=2)
        slot = scribe.s32[b].Parameter(parameter_number=3)
        pad = scribe.s32[b].Parameter(parameter_number=4)
        return decode_attention_kernel(q, k, v, slot, pad, scale=d ** -0.5)

    costs = module_kernel_costs(compile_py_func(program))
    query_and_out = 2 * nbytes("f32", b, h, 1, d)
    caches = 2 * nbytes(dtype, b, kv_heads, slots, row)
    slot_pad_lines_and_scale = 3 * nbytes("s32", b) + nbytes("f32")
    assert costs.calls == {cpu_kernels.DECODE_ATTENTION_TARGET: 1}
    assert costs.upper_bound_targets == (cpu_kernels.DECODE_ATTENTION_TARGET,)
    # q.k and p.v over every slot, one exponential per score
    assert costs.total == KernelCost(flops=2 * 2 * b * h * slots * d, transcendentals=b * h * slots,
                                     bytes_accessed=query_and_out + caches + slot_pad_lines_and_scale,
                                     upper_bound=True)


def test_calls_add_up_and_other_custom_calls_are_left_uncounted():
    def program(scribe):
        x = scribe.f32[3, 64].Parameter(parameter_number=0)
        w = scribe.f32[32, 64].Parameter(parameter_number=1)
        u = scribe.f32[64, 32].Parameter(parameter_number=2)
        hidden = linalg.matvec_kernel(x, w)
        other = scribe.f32[3, 32].CustomCall(hidden, custom_call_target="someone_elses_kernel")
        return linalg.matvec_kernel(other, u)

    costs = module_kernel_costs(compile_py_func(program))
    assert costs.calls == {cpu_kernels.MATVEC_TARGET: 2}
    assert costs.uncounted == {"someone_elses_kernel": 1}
    assert costs.total.flops == 2 * 3 * 64 * 32 + 2 * 3 * 32 * 64
    assert not costs.total.upper_bound and costs.upper_bound_targets == ()
