"""pyhlo's matrix-vector kernel on weights in GGUF block forms (Q8_0, Q4_0, Q4_1) equals
numpy on the same blocks dequantized (tests/test_quantized_blocks.py proves that numpy
reading equal to the gguf package's), at 1-8 activation rows; and the prefill GEMM kernel with
int8 activations at many rows."""
from __future__ import annotations

import numpy as np
import pytest
from child_env import python_path
from hlo_run import run_fn
from hypothesis import given, settings
from hypothesis import strategies as st
from test_quantized_blocks import FORMS, random_blocks

from decoders.weights.quantize import dequantize_blocks
from pyhlo.ops import linalg
from pyhlo.shape_inference import HloShapeError
from runtime import cpu_kernels

pytestmark = pytest.mark.cpu_only
SCRIBE_TYPES = {"int8": "s8", "uint8": "u8", "float16": "f16", "float32": "f32"}


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert cpu_kernels.register(), "the CPU kernels did not build"


def run_kernel(x: np.ndarray, arrays: list[np.ndarray], int8_activations: bool = False,
               gemm: bool = False, exact_gemm: bool = False) -> np.ndarray:
    def program(scribe):
        params = [getattr(scribe, SCRIBE_TYPES[a.dtype.name])[a.shape].Parameter(parameter_number=i)
                  for i, a in enumerate([x, *arrays])]
        if exact_gemm:
            return linalg.gemm_blocks_kernel(*params)
        if gemm:
            return linalg.gemm_blocks_x8_kernel(*params)
        return linalg.matvec_blocks_kernel(*params, int8_activations=int8_activations)

    (out,) = run_fn(program, x, *arrays)
    return out


# n covers the thread chunks and their tails; rows every group size (1-4, then 4 + 1-4).
@settings(max_examples=40, deadline=None)
@given(form=st.sampled_from(FORMS), lead=st.sampled_from([(1,), (3,), (4,), (5,), (8,), (2, 3)]),
       n=st.integers(1, 70), blocks=st.integers(1, 10), seed=st.integers(0, 2**32 - 1))
def test_block_kernels_match_numpy(form, lead, n, blocks, seed):
    k = 32 * blocks
    weight = random_blocks(form, n, k, seed)
    x = np.random.default_rng(seed + 1).standard_normal((*lead, k)).astype(np.float32)
    out = run_kernel(x, [a for a in weight[1:] if a is not None])
    w = dequantize_blocks(weight).astype(np.float64)
    expected = x.astype(np.float64) @ w.T
    bound = np.abs(x).astype(np.float64) @ np.abs(w).T         # the size of the sum's terms
    assert out.shape == (*lead, n) and out.dtype == np.float32
    assert (np.abs(out - expected) <= 1e-5 * bound + 1e-30).all()


def rounded_activations(x: np.ndarray) -> np.ndarray:
    """x rounded per 32 values as the _x8 kernels round it: d = max |x| / 127 (f32), q =
    round(x * (1 / d)) half to even; returned as d * q."""
    blocks = x.reshape(*x.shape[:-1], -1, 32).astype(np.float32)
    d = (np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inverse = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.clip(np.rint(blocks * inverse), -127, 127)
    return (d.astype(np.float64) * q).reshape(x.shape)


def check_rounded_product(out: np.ndarray, x: np.ndarray, w: np.ndarray) -> None:
    """An int8-activation kernel's product: numpy's on the rounded activations to f32 rounding,
    and within the rounding's reach of the exact product (each activation moved by
    |x - rounded|, at most half a step)."""
    rounded = rounded_activations(x)
    bound = np.abs(rounded) @ np.abs(w).T
    assert (np.abs(out - rounded @ w.T) <= 1e-5 * bound + 1e-30).all()
    reach = np.abs(x.astype(np.float64) - rounded) @ np.abs(w).T
    assert (np.abs(out - x.astype(np.float64) @ w.T) <= reach + 1e-5 * bound + 1e-30).all()


# The integer kernels against numpy on the rounded activations: the same function, to f32
# rounding; and within the rounding's reach of the exact product.
@settings(max_examples=40, deadline=None)
@given(form=st.sampled_from(FORMS), lead=st.sampled_from([(1,), (3,), (4,), (5,), (8,), (2, 3)]),
       n=st.integers(1, 70), blocks=st.integers(1, 10), seed=st.integers(0, 2**32 - 1))
def test_int8_activation_block_kernels_match_numpy(form, lead, n, blocks, seed):
    k = 32 * blocks
    weight = random_blocks(form, n, k, seed)
    x = np.random.default_rng(seed + 1).standard_normal((*lead, k)).astype(np.float32)
    out = run_kernel(x, [a for a in weight[1:] if a is not None], int8_activations=True)
    assert out.shape == (*lead, n) and out.dtype == np.float32
    check_rounded_product(out, x, dequantize_blocks(weight).astype(np.float64))


# The prefill GEMM: the same function as the _x8 matvec kernels (numpy on the rounded
# activations, to f32 rounding), at row counts past the tiles of 4 rows and weight rows past
# the panels of 32 (odd n: a panel half padded).
@settings(max_examples=30, deadline=None)
@given(form=st.sampled_from(FORMS), lead=st.sampled_from([(1,), (5,), (17,), (128,), (3, 7)]),
       n=st.sampled_from([1, 15, 17, 33, 67, 100]), blocks=st.integers(1, 9), seed=st.integers(0, 2**32 - 1))
def test_int8_activation_gemm_kernels_match_numpy(form, lead, n, blocks, seed):
    k = 32 * blocks
    weight = random_blocks(form, n, k, seed)
    x = np.random.default_rng(seed + 1).standard_normal((*lead, k)).astype(np.float32)
    x[..., :32] *= 100                      # blocks of different scales in one row
    out = run_kernel(x, [a for a in weight[1:] if a is not None], gemm=True)
    assert out.shape == (*lead, n) and out.dtype == np.float32
    check_rounded_product(out, x, dequantize_blocks(weight).astype(np.float64))


# The exact prefill GEMM: numpy on the widened weights, to f32 rounding, at row counts past the
# tiles of 12 rows, weight rows past the panels of 32 and k past the panels' chunks of 1024.
@settings(max_examples=30, deadline=None)
@given(form=st.sampled_from(FORMS), lead=st.sampled_from([(1,), (11,), (13,), (25,), (128,), (3, 7)]),
       n=st.sampled_from([1, 15, 17, 33, 67, 100]), blocks=st.sampled_from([1, 2, 5, 9, 33, 70]),
       seed=st.integers(0, 2**32 - 1))
def test_exact_gemm_kernels_match_numpy(form, lead, n, blocks, seed):
    weight = random_blocks(form, n, 32 * blocks, seed)
    w = dequantize_blocks(weight).astype(np.float64)
    x = np.random.default_rng(seed + 1).standard_normal((*lead, w.shape[1])).astype(np.float32)
    out = run_kernel(x, [a for a in weight[1:] if a is not None], exact_gemm=True)
    assert out.shape == (*lead, n) and out.dtype == np.float32
    bound = np.abs(x).astype(np.float64) @ np.abs(w).T
    assert (np.abs(out - x.astype(np.float64) @ w.T) <= 1e-5 * bound + 1e-30).all()


def run_int8_weight_gemm(kernel, x: np.ndarray, w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """kernel (gemm_s8_x8_kernel or gemm_s8_kernel) on x, int8 w and its scales per row."""
    def program(scribe):
        return kernel(scribe.f32[x.shape].Parameter(parameter_number=0),
                      scribe.s8[w.shape].Parameter(parameter_number=1),
                      scribe.f32[scale.shape].Parameter(parameter_number=2))

    (out,) = run_fn(program, x, w, scale)
    return out


# The prefill GEMM of int8 weights with a scale per row (NeuronConfig.quant): numpy on the
# rounded activations and the widened weights, to f32 rounding, and within the rounding's reach
# of the exact product; rows past the tiles and weight rows past the panels as above.
@settings(max_examples=30, deadline=None)
@given(lead=st.sampled_from([(1,), (5,), (17,), (128,), (3, 7)]), n=st.sampled_from([1, 15, 17, 33, 67, 100]),
       blocks=st.integers(1, 9), seed=st.integers(0, 2**32 - 1))
def test_int8_weight_gemm_kernel_matches_numpy(lead, n, blocks, seed):
    rng = np.random.default_rng(seed)
    k = 32 * blocks
    w = rng.integers(-127, 128, (n, k), dtype=np.int8)
    scale = (rng.random(n, dtype=np.float32) * 0.02 + 1e-4).astype(np.float32)
    x = rng.standard_normal((*lead, k)).astype(np.float32)
    x[..., :32] *= 100                      # blocks of different scales in one row
    out = run_int8_weight_gemm(linalg.gemm_s8_x8_kernel, x, w, scale)
    assert out.shape == (*lead, n) and out.dtype == np.float32
    check_rounded_product(out, x, w.astype(np.float64) * scale.astype(np.float64)[:, None])


# Its exact form: numpy on the widened weights, to f32 rounding; k need not be a multiple of 32
# and may pass the panels' chunks of 1024 values.
@settings(max_examples=30, deadline=None)
@given(lead=st.sampled_from([(1,), (13,), (128,), (3, 7)]), n=st.sampled_from([1, 17, 33, 100]),
       k=st.sampled_from([1, 7, 64, 100, 1030, 2100]), seed=st.integers(0, 2**32 - 1))
def test_exact_int8_weight_gemm_kernel_matches_numpy(lead, n, k, seed):
    rng = np.random.default_rng(seed)
    w = rng.integers(-127, 128, (n, k), dtype=np.int8)
    scale = (rng.random(n, dtype=np.float32) * 0.02 + 1e-4).astype(np.float32)
    x = rng.standard_normal((*lead, k)).astype(np.float32)
    out = run_int8_weight_gemm(linalg.gemm_s8_kernel, x, w, scale)
    assert out.shape == (*lead, n) and out.dtype == np.float32
    widened = w.astype(np.float64) * scale.astype(np.float64)[:, None]
    bound = np.abs(x).astype(np.float64) @ np.abs(widened).T
    assert (np.abs(out - x.astype(np.float64) @ widened.T) <= 1e-5 * bound + 1e-30).all()


def test_gemm_kernel_splits_a_prefill_across_threads_and_agrees_with_the_matvec_kernel():
    for form in FORMS:
        weight = random_blocks(form, 1001, 576, 3)
        arrays = [a for a in weight[1:] if a is not None]
        x = np.random.default_rng(4).standard_normal((130, 576)).astype(np.float32)
        gemm = run_kernel(x, arrays, gemm=True)
        matvec = run_kernel(x, arrays, int8_activations=True)
        bound = np.abs(rounded_activations(x)) @ np.abs(dequantize_blocks(weight).astype(np.float64)).T
        assert (np.abs(gemm - matvec) <= 1e-5 * bound).all(), form


def test_a_large_head_splits_across_threads_and_stays_exact():
    weight = random_blocks("q8_0", 4099, 576, 7)
    x = np.random.default_rng(0).standard_normal((1, 576)).astype(np.float32)
    out = run_kernel(x, list(weight[1:3]))
    w = dequantize_blocks(weight).astype(np.float64)
    bound = np.abs(x).astype(np.float64) @ np.abs(w).T
    assert (np.abs(out - x.astype(np.float64) @ w.T) <= 1e-5 * bound).all()


def test_block_kernel_rejects_shapes_it_cannot_run():
    def build(x_shape, values, scales, mins=None):
        def program(scribe):
            return linalg.matvec_blocks_kernel(
                scribe.f32[x_shape].Parameter(parameter_number=0),
                getattr(scribe, values[0])[values[1]].Parameter(parameter_number=1),
                scribe.f16[scales].Parameter(parameter_number=2),
                None if mins is None else scribe.f16[mins].Parameter(parameter_number=3))
        return program

    from pyhlo import compile_py_func

    with pytest.raises(HloShapeError, match="k a multiple of 32"):
        compile_py_func(build((1, 40), ("s8", (4, 40)), (4, 1)))
    with pytest.raises(HloShapeError, match="u8 values"):
        compile_py_func(build((1, 64), ("u8", (4, 64)), (4, 2)))              # Q4 values are k/2 bytes
    with pytest.raises(HloShapeError, match="mins"):
        compile_py_func(build((1, 64), ("s8", (4, 64)), (4, 2), (4, 2)))       # Q8_0 has no minimums

    def gemm(scribe):
        return linalg.gemm_blocks_x8_kernel(scribe.f32[128, 64].Parameter(parameter_number=0),
                                            scribe.u8[4, 64].Parameter(parameter_number=1),
                                            scribe.f16[4, 2].Parameter(parameter_number=2))
    with pytest.raises(HloShapeError, match="gemm_blocks_x8_kernel: .*u8 values"):
        compile_py_func(gemm)

    def gemm_s8(scribe):
        return linalg.gemm_s8_x8_kernel(scribe.f32[128, 40].Parameter(parameter_number=0),
                                        scribe.s8[4, 40].Parameter(parameter_number=1),
                                        scribe.f32[4].Parameter(parameter_number=2))
    with pytest.raises(HloShapeError, match="gemm_s8_x8_kernel: .*k a multiple of 32"):
        compile_py_func(gemm_s8)


KERNEL_FORMS = {"avx2": "-mno-avx512f", "portable": "-mno-avx2 -mno-avx512f"}


@pytest.mark.parametrize("form", sorted(KERNEL_FORMS))
def test_every_instruction_set_form_of_the_kernels_matches_numpy(form):
    """The kernels built without AVX-512 (the AVX2 forms, on a host with AVX2) and without
    AVX2 (the portable forms) pass this file's and the attention kernels' checks."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYHLO_KERNEL_FLAGS=KERNEL_FORMS[form], PYTHONPATH=python_path(here.parent))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           str(here / "test_cpu_kernels_blocks.py"), str(here / "test_cpu_kernels.py"),
                           str(here / "test_prefill_attention.py"),
                           "-k", "(match or packed or large_head) and not instruction_set"],
                          env=env, capture_output=True, text=True, timeout=900, cwd=here.parent)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout
