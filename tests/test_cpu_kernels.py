"""pyhlo's CPU matrix-vector kernel (runtime/kernels/matvec.cc) through XLA's typed FFI:
against numpy, and where the decoder uses it."""
from __future__ import annotations

import numpy as np
import pytest
from hlo_run import run_fn
from hypothesis import given, settings
from hypothesis import strategies as st

from pyhlo.dtypes import numpy_dtype
from pyhlo.ops import linalg
from pyhlo.ops.attention import decode_attention_kernel
from pyhlo.shape_inference import HloShapeError
from runtime import cpu_kernels

BF16 = numpy_dtype("bf16")
pytestmark = pytest.mark.cpu_only


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert cpu_kernels.register(), "the CPU kernels did not build"


# Rows cover every activation group size (1-4 and beyond, in groups of 4); k covers
# whole vectors, tails and odd lengths (bf16 pairs); n covers thread chunks and tails.
@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.integers(1, 3), min_size=1, max_size=2), k=st.integers(1, 200),
       n=st.integers(1, 300), dtype=st.sampled_from(["f32", "bf16"]), x_in_bf16=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_matvec_kernel_matches_numpy(rows, k, n, dtype, x_in_bf16, seed):
    # x_in_bf16: activations that are exactly bf16 values (a bf16 model's), which take the
    # kernel's bf16-pair path when the weights are bf16 too.
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((*rows, k)).astype(BF16 if x_in_bf16 else np.float32).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(numpy_dtype(dtype))

    def program(scribe):
        a = scribe.f32[x.shape].Parameter(parameter_number=0)
        b = getattr(scribe, dtype)[w.shape].Parameter(parameter_number=1)
        return linalg.matvec_kernel(a, b)

    (out,) = run_fn(program, x, w)
    expected = x.astype(np.float64) @ w.astype(np.float64).T     # bf16 weights are exact in f64
    assert out.shape == (*rows, n) and out.dtype == np.float32
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4 * np.sqrt(k))


# The bf16 prefill GEMM: numpy on the widened weights, to f32 rounding; rows past the tiles, weight
# rows past the panels, k past the panels' chunks of 1024 values and odd tails; a bf16 model's
# activations (exactly bf16) and others.
@settings(max_examples=30, deadline=None)
@given(lead=st.sampled_from([(1,), (5,), (13,), (128,), (3, 7)]), n=st.sampled_from([1, 15, 17, 33, 100]),
       k=st.sampled_from([1, 7, 64, 100, 1030, 2100]), x_in_bf16=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_bf16_gemm_kernel_matches_numpy(lead, n, k, x_in_bf16, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((*lead, k)).astype(BF16 if x_in_bf16 else np.float32).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(BF16)

    def program(scribe):
        return linalg.gemm_bf16_kernel(scribe.f32[x.shape].Parameter(parameter_number=0),
                                       scribe.bf16[w.shape].Parameter(parameter_number=1))

    (out,) = run_fn(program, x, w)
    widened = w.astype(np.float64)
    bound = np.abs(x).astype(np.float64) @ np.abs(widened).T       # the size of the sum's terms
    assert out.shape == (*lead, n) and out.dtype == np.float32
    assert (np.abs(out - x.astype(np.float64) @ widened.T) <= 1e-5 * bound + 1e-30).all()


def test_bf16_gemm_kernel_rejects_operands_it_cannot_run():
    with pytest.raises(HloShapeError, match="bf16 w"):
        run_fn(lambda scribe: linalg.gemm_bf16_kernel(scribe.f32[2, 8].Parameter(parameter_number=0),
                                                      scribe.f32[3, 8].Parameter(parameter_number=1)),
               np.zeros((2, 8), np.float32), np.zeros((3, 8), np.float32))


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 8), k=st.integers(1, 200), n=st.integers(1, 300), seed=st.integers(0, 2**32 - 1))
def test_int8_matvec_kernel_matches_numpy(rows, k, n, seed):
    """int8 weights with one scale per row: scale * (x @ w.T), rows 1-8, every k tail."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.integers(-127, 128, (n, k)).astype(np.int8)
    scale = (rng.random(n) / 64).astype(np.float32)

    def program(scribe):
        return linalg.matvec_kernel(scribe.f32[x.shape].Parameter(parameter_number=0),
                                    scribe.s8[w.shape].Parameter(parameter_number=1),
                                    scribe.f32[n].Parameter(parameter_number=2))

    (out,) = run_fn(program, x, w, scale)
    expected = scale * (x.astype(np.float64) @ w.astype(np.float64).T)
    assert out.shape == (rows, n) and out.dtype == np.float32
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4 * np.sqrt(k) * scale.max() * 127)


@pytest.mark.parametrize("rows", [1, 3, 4, 8])
@pytest.mark.parametrize("k", [127, 2081])
def test_bf16_pair_kernel_rows_tails_and_shrinking_chunks(rows, k):
    """Activations exactly bf16 with bf16 weights (the bf16-pair path on AVX512-BF16 CPUs):
    1-8 activation rows, k shorter than one 128-wide step and past several with a tail, and
    enough weight rows for the threads' chunks to shrink down to the smallest."""
    rng = np.random.default_rng(rows * k)
    n = 3001
    x = rng.standard_normal((rows, k)).astype(BF16).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(BF16)

    def program(scribe):
        return linalg.matvec_kernel(scribe.f32[rows, k].Parameter(parameter_number=0),
                                    scribe.bf16[n, k].Parameter(parameter_number=1))

    (out,) = run_fn(program, x, w)
    np.testing.assert_allclose(out, x.astype(np.float64) @ w.astype(np.float64).T, rtol=1e-4,
                               atol=1e-4 * np.sqrt(k))


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("k", [127, 2081])
def test_bf16_activations_with_bf16_weights(rows, k):
    """x passed as bf16 (a bf16 model's activations, kept rounded): the product of the bf16
    values, exact in f64."""
    rng = np.random.default_rng(rows + k)
    n = 3001
    x = rng.standard_normal((rows, k)).astype(BF16)
    w = rng.standard_normal((n, k)).astype(BF16)

    def program(scribe):
        return linalg.matvec_kernel(scribe.bf16[rows, k].Parameter(parameter_number=0),
                                    scribe.bf16[n, k].Parameter(parameter_number=1))

    (out,) = run_fn(program, x, w)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, x.astype(np.float64) @ w.astype(np.float64).T, rtol=1e-4,
                               atol=1e-4 * np.sqrt(k))


def test_large_product_splits_across_threads_and_stays_exact():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 576)).astype(np.float32)
    w = rng.standard_normal((5003, 576)).astype(BF16)

    def program(scribe):
        return linalg.matvec_kernel(scribe.f32[2, 576].Parameter(parameter_number=0),
                                    scribe.bf16[5003, 576].Parameter(parameter_number=1))

    (out,) = run_fn(program, x, w)
    np.testing.assert_allclose(out, x.astype(np.float64) @ w.astype(np.float64).T, rtol=1e-4, atol=1e-3)


def test_products_from_several_threads_at_once_each_get_their_own_rows():
    """Helpers that linger between products pick up whichever product was posted last: with
    programs run from three threads at once, chained products of different shapes, every
    result still equals numpy's (a helper computing rows of the wrong product, or after its
    caller returned, would show here)."""
    import threading

    from pyhlo import compile_py_func
    from runtime.select import get_backend

    backend = get_backend()
    rng = np.random.default_rng(1)
    cases = []
    for n, k in [(4099, 96), (2050, 300), (1500, 64)]:
        x = rng.standard_normal((1, k)).astype(np.float32)
        ws = [rng.standard_normal((n, k)).astype(BF16) for _ in range(3)]

        def program(scribe, n=n, k=k):
            a = scribe.f32[1, k].Parameter(parameter_number=0)
            outs = [linalg.matvec_kernel(a, scribe.bf16[n, k].Parameter(parameter_number=1 + i))
                    for i in range(3)]
            return outs

        executable = backend.compile(compile_py_func(program).SerializeToString())
        expected = [x.astype(np.float64) @ w.astype(np.float64).T for w in ws]
        cases.append((executable, [x, *ws], expected))
    failures = []

    def run(case):
        executable, args, expected = case
        for _ in range(30):
            for out, want in zip(map(backend.to_host, executable.run(args)), expected):
                if not np.allclose(out, want, rtol=1e-4, atol=1e-3):
                    failures.append(float(np.abs(out - want).max()))

    threads = [threading.Thread(target=run, args=(case,)) for case in cases]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures


def reference_decode_attention(q, k, v, slot, pad, scale):
    b, h, _, d = q.shape
    group = h // k.shape[1]
    out = np.zeros((b, h, 1, d))
    for i in range(b):
        visible = slice(max(pad[i], 0), slot[i] + 1)
        for j in range(h):
            keys, values = (k[i, j // group, visible].astype(np.float64),
                            v[i, j // group, visible].astype(np.float64))
            if len(keys) == 0:
                continue
            scores = keys @ q[i, j, 0].astype(np.float64) * scale
            weights = np.exp(scores - scores.max())
            out[i, j, 0] = weights @ values / weights.sum()
    return out


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 3), kvh=st.integers(1, 3), group=st.integers(1, 4), s=st.integers(1, 40),
       d=st.sampled_from([1, 7, 16, 64, 80, 128]), dtype=st.sampled_from(["f32", "bf16", "u16"]),
       more_lines=st.integers(0, 3), data=st.data())
def test_decode_attention_kernel_matches_numpy(b, kvh, group, s, d, dtype, more_lines, data):
    """u16: bf16 values as their bits. With more cache lines than rows, each row reads the line
    `lines` names (continuous batching's programs for some lines); else row i line i."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    # Each line at its own length (continuous batching), its left padding below it.
    slot = np.array(data.draw(st.lists(st.integers(0, s - 1), min_size=b, max_size=b)), np.int32)
    pad = np.array([data.draw(st.integers(0, int(last))) for last in slot], np.int32)
    n_lines = b + more_lines
    lines = rng.choice(n_lines, b, replace=False).astype(np.int32) if more_lines else None
    h = kvh * group
    q = rng.standard_normal((b, h, 1, d)).astype(np.float32)
    values = "bf16" if dtype == "u16" else dtype
    k = rng.standard_normal((n_lines, kvh, s, d)).astype(numpy_dtype(values))
    v = rng.standard_normal((n_lines, kvh, s, d)).astype(numpy_dtype(values))
    scale = 1 / np.sqrt(d)

    def program(scribe):
        return decode_attention_kernel(
            scribe.f32[q.shape].Parameter(parameter_number=0),
            getattr(scribe, dtype)[k.shape].Parameter(parameter_number=1),
            getattr(scribe, dtype)[v.shape].Parameter(parameter_number=2),
            scribe.s32[b].Parameter(parameter_number=3), scribe.s32[b].Parameter(parameter_number=4), scale,
            None if lines is None else scribe.s32[b].Parameter(parameter_number=5))

    stored = (k.view(np.uint16), v.view(np.uint16)) if dtype == "u16" else (k, v)
    (out,) = run_fn(program, q, *stored, slot, pad, *([] if lines is None else [lines]))
    read = np.arange(b) if lines is None else lines
    np.testing.assert_allclose(out, reference_decode_attention(q, k[read], v[read], slot, pad, scale),
                               rtol=1e-4, atol=1e-5)


def test_decode_attention_kernel_needs_a_line_for_each_row_of_fewer_caches():
    def program(scribe):
        return decode_attention_kernel(scribe.f32[1, 2, 1, 8].Parameter(parameter_number=0),
                                       scribe.f32[3, 2, 4, 8].Parameter(parameter_number=1),
                                       scribe.f32[3, 2, 4, 8].Parameter(parameter_number=2),
                                       scribe.s32[1].Parameter(parameter_number=3),
                                       scribe.s32[1].Parameter(parameter_number=4), 0.5)

    with pytest.raises(HloShapeError, match="lines"):
        run_fn(program, np.zeros((1, 2, 1, 8), np.float32), np.zeros((3, 2, 4, 8), np.float32),
               np.zeros((3, 2, 4, 8), np.float32), np.zeros(1, np.int32), np.zeros(1, np.int32))


@settings(max_examples=30, deadline=None)
@given(b=st.integers(1, 3), kvh=st.integers(1, 3), group=st.integers(1, 4), s=st.integers(1, 40),
       d=st.sampled_from([1, 7, 16, 64, 80]), data=st.data())
def test_decode_attention_kernel_reads_packed_int8_rows(b, kvh, group, s, d, data):
    """Packed rows (d int8 values, then the f32 scale's bytes) attend as scale * values."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    # Each line at its own length (continuous batching), its left padding below it.
    slot = np.array(data.draw(st.lists(st.integers(0, s - 1), min_size=b, max_size=b)), np.int32)
    pad = np.array([data.draw(st.integers(0, int(last))) for last in slot], np.int32)
    h = kvh * group
    q = rng.standard_normal((b, h, 1, d)).astype(np.float32)

    def packed_rows():
        values = rng.integers(-127, 128, (b, kvh, s, d), dtype=np.int8)
        scales = rng.uniform(1e-3, 0.1, (b, kvh, s, 1)).astype(np.float32)
        return np.concatenate([values, scales.view(np.int8)], axis=3), values * scales

    (k, k_wide), (v, v_wide) = packed_rows(), packed_rows()
    scale = 1 / np.sqrt(d)

    def program(scribe):
        return decode_attention_kernel(
            scribe.f32[q.shape].Parameter(parameter_number=0),
            scribe.s8[k.shape].Parameter(parameter_number=1),
            scribe.s8[v.shape].Parameter(parameter_number=2), scribe.s32[b].Parameter(parameter_number=3),
            scribe.s32[b].Parameter(parameter_number=4), scale)

    (out,) = run_fn(program, q, k, v, slot, pad)
    np.testing.assert_allclose(out, reference_decode_attention(q, k_wide, v_wide, slot, pad, scale),
                               rtol=1e-4, atol=1e-5)


def test_matvec_kernel_rejects_shapes_it_cannot_run():
    def program(scribe):
        return linalg.matvec_kernel(scribe.f32[1, 8].Parameter(parameter_number=0),
                                    scribe.f32[4, 9].Parameter(parameter_number=1))

    with pytest.raises(HloShapeError, match="matvec_kernel"):
        run_fn(program, np.zeros((1, 8), np.float32), np.zeros((4, 9), np.float32))


@settings(max_examples=20, deadline=None)
@given(dims=st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple), half=st.integers(1, 40),
       style=st.sampled_from(["half", "interleaved"]), theta=st.sampled_from([1e4, 5e5, 1e6]),
       seed=st.integers(0, 2**32 - 1))
def test_rotary_table_kernel_matches_numpy_and_the_program(dims, half, style, theta, seed):
    """The kernel's cos and sin of position x frequency (an f32 product, as HF computes it)
    against numpy's, and against the program's own tables (XLA's cos and sin)."""
    from pyhlo.ops import nn

    positions = np.random.default_rng(seed).integers(0, 40000, dims).astype(np.int32)
    inv_freq = (1.0 / theta ** (np.arange(half) / half)).astype(np.float32)

    def program(scribe):
        at = scribe.s32[dims].Parameter(parameter_number=0)
        return [*nn.rotary_cos_sin_kernel(at, inv_freq, style), *nn.rotary_cos_sin(at, inv_freq, style)]

    cos, sin, xla_cos, xla_sin = run_fn(program, positions)
    freqs = np.concatenate([inv_freq, inv_freq]) if style == "half" else np.repeat(inv_freq, 2)
    angles = positions[..., None].astype(np.float32) * freqs
    assert cos.shape == sin.shape == (*dims, 2 * half)
    np.testing.assert_allclose(cos, np.cos(angles), rtol=0, atol=1e-6)
    np.testing.assert_allclose(sin, np.sin(angles), rtol=0, atol=1e-6)
    # XLA reduces large angles less exactly: the same tables to within its error.
    np.testing.assert_allclose(cos, xla_cos, rtol=0, atol=1e-4)
    np.testing.assert_allclose(sin, xla_sin, rtol=0, atol=1e-4)


def test_rotary_table_kernel_takes_s32_positions():
    from pyhlo.ops import nn

    def program(scribe):
        positions = scribe.f32[1, 3].Parameter(parameter_number=0)
        return nn.rotary_cos_sin_kernel(positions, np.ones(2, np.float32))

    with pytest.raises(HloShapeError, match="positions must be s32"):
        run_fn(program, np.zeros((1, 3), np.float32))


def test_decode_block_calls_the_kernels_and_prefill_its_rotary_tables_and_attention(tiny_llama):
    from decoders import LlamaForSampling, NeuronConfig
    from decoders.lowering import CpuKernelLowering
    from decoders.programs.keys import Block

    _, path = tiny_llama("gqa_tied_llama3", "safetensors")
    model = LlamaForSampling.from_pretrained(path, n_positions=128, context_length_estimate=[16])
    assert isinstance(model.lowering, CpuKernelLowering) and model.lowering.weight_layout == "out_in"
    decode = model.programs.build(Block(1, 128)).module.SerializeToString()
    prefill = model.programs.build(Block(16, 16)).module.SerializeToString()
    assert all(target.encode() in decode
               for target in (cpu_kernels.MATVEC_TARGET, cpu_kernels.DECODE_ATTENTION_TARGET,
                              cpu_kernels.ROTARY_COS_SIN_TARGET))
    # Prefill's products are XLA's own; its rotary tables and attention come from the kernels.
    attention = [cpu_kernels.PREFILL_ATTENTION_TARGET] if cpu_kernels.prefill_attention_is_fast() else []
    assert {target for target in cpu_kernels.TARGETS if target.encode() in prefill} == \
        {cpu_kernels.ROTARY_COS_SIN_TARGET, *attention}

    off = LlamaForSampling.from_pretrained(path, n_positions=128,
                                           neuron_config=NeuronConfig(cpu_kernels=False))
    assert not isinstance(off.lowering, CpuKernelLowering)
    assert not cpu_kernels.referenced_by(off.programs.build(Block(1, 128)).module.SerializeToString())

    with pytest.raises(ValueError, match="weight_layout='in_out'"):
        LlamaForSampling.from_pretrained(path, n_positions=128,
                                         neuron_config=NeuronConfig(cpu_kernels=True, weight_layout="in_out"))


def test_a_bf16_prompt_takes_the_bf16_gemm_where_it_is_the_fast_one(tiny_llama, monkeypatch):
    """amp bf16: a prompt's products take pyhlo_gemm_bf16 where bf16_gemm_is_fast() (no bf16 dot
    instructions for XLA's), XLA's dot otherwise; both give the same greedy tokens and logits
    within bf16 rounding (only the order of the f32 sums differs)."""
    import torch

    from decoders import LlamaForSampling
    from decoders.programs.keys import Block

    _, path = tiny_llama("gqa_tied_llama3", "safetensors")
    shape = dict(batch_size=1, n_positions=64, context_length_estimate=[16], amp="bf16")
    runs = {}
    for kernel in (True, False):
        monkeypatch.setattr(cpu_kernels, "bf16_gemm_is_fast", lambda kernel=kernel: kernel)
        model = LlamaForSampling.from_pretrained(path, **shape).to_neuron()
        prefill = model.programs.build(Block(16, 16)).module.SerializeToString()
        assert (cpu_kernels.GEMM_BF16_TARGET.encode() in prefill) == kernel
        runs[kernel] = model.sample(torch.arange(5, 17)[None], sequence_length=30, top_k=1, eos_token_id=[],
                                    output_scores=True)
    (tokens, scores), (expected_tokens, expected_scores) = runs[True], runs[False]
    assert torch.equal(tokens, expected_tokens)
    first, expected_first = np.asarray(scores[0], np.float32), np.asarray(expected_scores[0], np.float32)
    np.testing.assert_allclose(first, expected_first, rtol=0, atol=0.05 * np.abs(expected_first).max())


def test_a_program_calling_the_kernel_fails_clearly_when_kernels_are_off(monkeypatch):
    from runtime.select import get_backend

    def program(scribe):
        return linalg.matvec_kernel(scribe.f32[1, 4].Parameter(parameter_number=0),
                                    scribe.f32[2, 4].Parameter(parameter_number=1))

    from pyhlo import compile_py_func

    monkeypatch.setenv("PYHLO_CPU_KERNELS", "0")
    with pytest.raises(RuntimeError, match="cpu_kernels=False"):
        get_backend().compile(compile_py_func(program).SerializeToString())


def test_build_reports_a_missing_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("PYHLO_KERNEL_DIR", str(tmp_path))
    with pytest.raises(cpu_kernels.KernelBuildError, match="failed"):
        cpu_kernels.build(compiler="false")


def test_kernel_calls_keep_row_major_layouts():
    """XLA may otherwise lay a kernel's [2, n] result out column-major (seen feeding an
    all-gather along n) and read the kernel's rows as columns."""
    from pyhlo import compile_py_func

    def program(scribe):
        return linalg.matvec_kernel(scribe.f32[2, 8].Parameter(parameter_number=0),
                                    scribe.f32[6, 8].Parameter(parameter_number=1))

    module = compile_py_func(program)
    (call,) = [i for c in module.computations for i in c.instructions if i.opcode == "custom-call"]
    assert call.constrain_layout and list(call.shape.layout.minor_to_major) == [1, 0]
    assert [list(s.layout.minor_to_major) for s in call.operand_shapes_with_layout] == [[1, 0], [1, 0]]
