"""pyhlo's matrix-vector kernels on weights kept as a GGUF file stores them (Q5_0, Q5_1, the
K-quants, IQ4_NL, IQ4_XS) equal numpy on the gguf package's dequantization of the same blocks,
at 1-8 activation rows, in every instruction-set form the host builds; the K-quants'
int8-activation kernels equal numpy on the activations rounded as llama.cpp's Q8_K rounds them."""
from __future__ import annotations

import numpy as np
import pytest
from child_env import python_path
from hlo_run import run_fn
from hypothesis import given, settings
from hypothesis import strategies as st
from test_gguf_kquant_blocks import gguf_dequantized, mixed_rows, random_gguf_blocks

from pyhlo.ops import linalg
from pyhlo.shape_inference import HloShapeError
from runtime import cpu_kernels

pytestmark = pytest.mark.cpu_only


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert cpu_kernels.register(), "the CPU kernels did not build"


def run_kernel(x: np.ndarray, data: np.ndarray, ggml_type: str, int8_activations: bool = False) -> np.ndarray:
    def program(scribe):
        return linalg.matvec_gguf_kernel(scribe.f32[x.shape].Parameter(parameter_number=0),
                                         scribe.u8[data.shape].Parameter(parameter_number=1), ggml_type,
                                         int8_activations=int8_activations)

    (out,) = run_fn(program, x, data)
    return out


# n covers the thread chunks and their tails; rows 1-8 and a 2-d lead.
@pytest.mark.parametrize("ggml_type", linalg.GGUF_KERNEL_TYPES)
@settings(max_examples=6, deadline=None)
@given(lead=st.sampled_from([(1,), (3,), (4,), (5,), (8,), (2, 3)]), n=st.integers(1, 40),
       blocks=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_each_gguf_kernel_matches_numpy(ggml_type, lead, n, blocks, seed):
    data = random_gguf_blocks(ggml_type, n, blocks, seed)
    w = gguf_dequantized(ggml_type, data).astype(np.float64)
    x = np.random.default_rng(seed + 1).standard_normal((*lead, w.shape[1])).astype(np.float32)
    out = run_kernel(x, data, ggml_type)
    expected = x.astype(np.float64) @ w.T
    bound = np.abs(x).astype(np.float64) @ np.abs(w).T         # the size of the sum's terms
    assert out.shape == (*lead, n) and out.dtype == np.float32
    assert (np.abs(out - expected) <= 1e-5 * bound + 1e-30).all()


@settings(max_examples=15, deadline=None)
@given(types=st.lists(st.sampled_from(["Q4_K", "Q6_K", "Q5_0", "Q8_0", "Q4_0", "Q4_1", "Q5_1"]), min_size=1,
                      max_size=9),
       lead=st.sampled_from([(1,), (3,), (8,)]), seed=st.integers(0, 2**32 - 1))
def test_the_kernel_of_rows_of_mixed_forms_matches_numpy(types, lead, seed):
    forms = tuple(sorted(set(types)))
    data, w = mixed_rows(types, forms, 512, seed)
    x = np.random.default_rng(seed + 1).standard_normal((*lead, 512)).astype(np.float32)

    def program(scribe):
        return linalg.matvec_gguf_rows_kernel(scribe.f32[x.shape].Parameter(parameter_number=0),
                                              scribe.u8[data.shape].Parameter(parameter_number=1), forms)

    (out,) = run_fn(program, x, data)
    w = w.astype(np.float64)
    bound = np.abs(x).astype(np.float64) @ np.abs(w).T
    assert out.shape == (*lead, len(types))
    assert (np.abs(out - x.astype(np.float64) @ w.T) <= 1e-5 * bound + 1e-30).all()


def q8_k_rounded(x: np.ndarray) -> np.ndarray:
    """x rounded per 256 values as llama.cpp's quantize_row_q8_K rounds it: `peak` the first value
    of largest magnitude, iscale = -127 / peak (f32), q = min(127, round(iscale * x)) ties to
    even, d = 1 / iscale; a block of zeros stays zero. Returned as d * q."""
    blocks = x.reshape(*x.shape[:-1], -1, 256).astype(np.float32)
    peak = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=-1)[..., None], axis=-1)
    nonzero = peak != 0
    iscale = np.where(nonzero, np.float32(-127) / np.where(nonzero, peak, 1), 0).astype(np.float32)
    q = np.minimum(127, np.rint(blocks * iscale))
    d = np.where(nonzero, np.float32(1) / np.where(nonzero, iscale, 1), 0).astype(np.float32)
    return (d.astype(np.float64) * q).reshape(x.shape)


def check_int8_activation_product(out: np.ndarray, x: np.ndarray, w: np.ndarray) -> None:
    """The product of w and x rounded as Q8_K, to f32 rounding; and within the rounding's reach of
    the exact product."""
    w = w.astype(np.float64)
    rounded = q8_k_rounded(x)
    bound = np.abs(rounded) @ np.abs(w).T
    assert (np.abs(out - rounded @ w.T) <= 1e-5 * bound + 1e-30).all()
    exact_bound = np.abs(x).astype(np.float64) @ np.abs(w).T
    assert (np.abs(out - x.astype(np.float64) @ w.T) <= 0.01 * exact_bound + 1e-30).all()


def test_q8_k_rounding_is_llama_cpps():
    """The reference rounding against numbers worked by hand: the peak's sign flips the scale, ties go
    to even, a block of zeros stays zero."""
    x = np.zeros((1, 512), np.float32)
    x[0, :6] = [-3.0, 0.5, 1.5, 2.5, 127.0, -127.0]   # peak 127 (the first of largest magnitude): iscale -1
    rounded = q8_k_rounded(x)
    # q = min(127, round(-x)): 3, -0 (a tie, to even), -2, -2 (ties), -127, 127; d = 1 / iscale = -1.
    np.testing.assert_array_equal(rounded[0, :6], [-3.0, 0.0, 2.0, 2.0, 127.0, -127.0])
    assert not rounded[0, 256:].any()


# Every activation row count (1-8), odd numbers of weight rows, a block of zero activations,
# and rows longer than the kernel's 2048-value pieces.
@pytest.mark.parametrize("ggml_type", linalg.GGUF_X8_KERNEL_TYPES)
@pytest.mark.parametrize("rows", range(1, 9))
def test_each_int8_activation_gguf_kernel_matches_numpy(ggml_type, rows):
    seed = 100 * rows + len(ggml_type)
    blocks = 9 if rows % 2 else 2
    data = random_gguf_blocks(ggml_type, 2 * rows + 3, blocks, seed)
    x = np.random.default_rng(seed + 1).standard_normal((rows, 256 * blocks)).astype(np.float32)
    x[0, 256:512] = 0
    out = run_kernel(x, data, ggml_type, int8_activations=True)
    assert out.shape == (rows, 2 * rows + 3) and out.dtype == np.float32
    check_int8_activation_product(out, x, gguf_dequantized(ggml_type, data))


@settings(max_examples=10, deadline=None)
@given(ggml_type=st.sampled_from(linalg.GGUF_X8_KERNEL_TYPES),
       lead=st.sampled_from([(1,), (4,), (7,), (2, 3)]), n=st.integers(1, 40), blocks=st.integers(1, 10),
       scale=st.sampled_from([1e-3, 1.0, 30.0]),
       seed=st.integers(0, 2**32 - 1))
def test_int8_activation_gguf_kernels_at_any_shape_matches_numpy(ggml_type, lead, n, blocks, scale, seed):
    data = random_gguf_blocks(ggml_type, n, blocks, seed)
    x = (scale * np.random.default_rng(seed + 1).standard_normal((*lead, 256 * blocks))).astype(np.float32)
    check_int8_activation_product(run_kernel(x, data, ggml_type, int8_activations=True), x,
                                  gguf_dequantized(ggml_type, data))


@settings(max_examples=10, deadline=None)
@given(types=st.lists(st.sampled_from(list(linalg.GGUF_X8_KERNEL_TYPES)), min_size=1, max_size=9),
       lead=st.sampled_from([(1,), (3,), (8,)]), seed=st.integers(0, 2**32 - 1))
def test_the_int8_activation_kernel_of_rows_of_mixed_k_quants_matches_numpy(types, lead, seed):
    forms = tuple(sorted(set(types)))
    data, w = mixed_rows(types, forms, 512, seed)
    x = np.random.default_rng(seed + 1).standard_normal((*lead, 512)).astype(np.float32)

    def program(scribe):
        return linalg.matvec_gguf_rows_kernel(scribe.f32[x.shape].Parameter(parameter_number=0),
                                              scribe.u8[data.shape].Parameter(parameter_number=1), forms,
                                              int8_activations=True)

    (out,) = run_fn(program, x, data)
    assert out.shape == (*lead, len(types))
    check_int8_activation_product(out, x, w)


def test_int8_activations_need_k_quants():
    from pyhlo import compile_py_func

    def program(scribe):
        return linalg.matvec_gguf_kernel(scribe.f32[1, 256].Parameter(parameter_number=0),
                                         scribe.u8[1, 176].Parameter(parameter_number=1), "Q5_0",
                                         int8_activations=True)

    with pytest.raises(HloShapeError, match="no int8-activation kernel for Q5_0"):
        compile_py_func(program)
    # The kernel of mixed rows checks each row's form when it runs: a Q4_0 row among K-quants.
    data, _ = mixed_rows(["Q4_K", "Q4_0"], ("Q4_K",), 256, 0)
    x = np.ones((1, 256), np.float32)

    def rows_program(scribe):
        return linalg.matvec_gguf_rows_kernel(scribe.f32[x.shape].Parameter(parameter_number=0),
                                              scribe.u8[data.shape].Parameter(parameter_number=1), ("Q4_K",),
                                              int8_activations=True)

    with pytest.raises(Exception, match="not a K-quant"):
        run_fn(rows_program, x, data)


def test_a_row_naming_no_form_is_a_clear_error():
    data, _ = mixed_rows(["Q4_K"], ("Q4_K",), 256, 0)
    data[0, -1] = 200
    x = np.ones((1, 256), np.float32)

    def program(scribe):
        return linalg.matvec_gguf_rows_kernel(scribe.f32[x.shape].Parameter(parameter_number=0),
                                              scribe.u8[data.shape].Parameter(parameter_number=1), ("Q4_K",))

    with pytest.raises(Exception, match="names no GGUF form"):
        run_fn(program, x, data)


def test_gguf_kernel_rejects_rows_of_partial_blocks():
    from pyhlo import compile_py_func

    def program(scribe):
        return linalg.matvec_gguf_kernel(scribe.f32[1, 256].Parameter(parameter_number=0),
                                         scribe.u8[4, 150].Parameter(parameter_number=1), "Q4_K")

    with pytest.raises(HloShapeError, match="Q4_K needs f32"):
        compile_py_func(program)


KERNEL_FORMS = {"avx2": "-mno-avx512f", "portable": "-mno-avx2 -mno-avx512f"}


@pytest.mark.parametrize("form", sorted(KERNEL_FORMS))
def test_every_instruction_set_form_of_the_gguf_kernels_matches_numpy(form):
    """The kernels built without AVX-512 and without AVX2 (the portable form) pass this file's
    checks."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYHLO_KERNEL_FLAGS=KERNEL_FORMS[form], PYTHONPATH=python_path(here.parent))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           str(here / "test_cpu_kernels_gguf.py"),
                           "-k", "matches_numpy and not instruction_set"],
                          env=env, capture_output=True, text=True, timeout=900, cwd=here.parent)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout
