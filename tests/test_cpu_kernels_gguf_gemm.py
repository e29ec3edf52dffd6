"""The int8 GEMMs of weights kept as a GGUF file stores them (the pyhlo_gemm_<form>_x8 targets, a
prefill's products; pyhlo_gemm_gguf_rows_x8 / _rows32_x8 for rows of mixed forms) equal numpy on
the gguf package's dequantization of the same blocks with the activations rounded as llama.cpp
rounds them for the form (Q8_K for the K-quants, Q8_1 for Q5_0, Q5_1, IQ4_NL and the other forms
of 32-value blocks), and the int8-activation matrix-vector kernel on the same operands; in the
form the host builds (AVX-512 VNNI, AVX2), and built without AVX-512 and without AVX2."""
from __future__ import annotations

import numpy as np
import pytest
from child_env import python_path
from hlo_run import run_fn
from test_cpu_kernels_gguf import check_int8_activation_product, q8_1_rounded, q8_k_rounded, run_kernel
from test_gguf_kquant_blocks import gguf_dequantized, mixed_rows, random_gguf_blocks

from pyhlo import compile_py_func
from pyhlo.ops import linalg
from pyhlo.ops.gguf_blocks import LAYOUTS, ROW_TAIL, unpack_mixed_rows
from pyhlo.shape_inference import HloShapeError
from runtime import cpu_kernels

pytestmark = pytest.mark.cpu_only


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert cpu_kernels.register(), "the CPU kernels did not build"


def run_gemm(x: np.ndarray, data: np.ndarray, ggml_type: str) -> np.ndarray:
    def program(scribe):
        return linalg.gemm_gguf_x8_kernel(scribe.f32[x.shape].Parameter(parameter_number=0),
                                          scribe.u8[data.shape].Parameter(parameter_number=1), ggml_type)

    (out,) = run_fn(program, x, data)
    return out


def random_operands(ggml_type: str, lead: tuple[int, ...], n: int, super_blocks: int, seed: int,
                    k: int | None = None):
    """Weights of k values a row (256 * super_blocks unless given) and activations whose first
    256 values are 100 times the rest's."""
    k = k or 256 * super_blocks
    data = random_gguf_blocks(ggml_type, n, k // LAYOUTS[ggml_type][0], seed)
    x = np.random.default_rng(seed + 1).standard_normal((*lead, k)).astype(np.float32)
    x[..., :256] *= 100                     # blocks of different scales in one row
    return x, data


# Activation rows around the tiles of 4 and up to a prompt's 130, weight rows around the panels
# of 32 (a half or more of the last one padded), one and several super-blocks, a 2-d lead.
@pytest.mark.parametrize("ggml_type", linalg.GGUF_GEMM_X8_KERNEL_TYPES)
@pytest.mark.parametrize("lead, n, super_blocks", [((1,), 5, 1), ((3,), 33, 3), ((6,), 17, 2),
                                                    ((2, 7), 40, 1), ((130,), 67, 2)])
def test_each_k_quant_gemm_matches_numpy(ggml_type, lead, n, super_blocks):
    x, data = random_operands(ggml_type, lead, n, super_blocks, seed=sum(lead) * 7 + n + len(ggml_type))
    x.reshape(-1, x.shape[-1])[0, 256:512] = 0         # a super-block of zero activations
    out = run_gemm(x, data, ggml_type)
    assert out.shape == (*lead, n) and out.dtype == np.float32
    check_int8_activation_product(out, x, [ggml_type] * n, data)


@pytest.mark.parametrize("ggml_type", ["Q4_K", "Q6_K"])
def test_the_gemm_splits_a_prefill_across_threads_and_agrees_with_the_matvec_kernel(ggml_type):
    """Many panels (more than threads), a prompt's rows: the same integer sums as the int8
    matrix-vector kernel, so the two differ only by the order of their f32 sums."""
    x, data = random_operands(ggml_type, (130,), 301, 3, seed=5)
    gemm = run_gemm(x, data, ggml_type)
    matvec = run_kernel(x, data, ggml_type, int8_activations=True)
    bound = np.abs(q8_k_rounded(x)) @ np.abs(gguf_dequantized(ggml_type, data).astype(np.float64)).T
    assert (np.abs(gemm - matvec) <= 1e-5 * bound + 1e-30).all()


def run_rows_gemm(x: np.ndarray, data: np.ndarray, forms: tuple[str, ...], gemm: bool = True) -> np.ndarray:
    def program(scribe):
        x_value = scribe.f32[x.shape].Parameter(parameter_number=0)
        data_value = scribe.u8[data.shape].Parameter(parameter_number=1)
        if gemm:
            return linalg.gemm_gguf_rows_x8_kernel(x_value, data_value, forms)
        return linalg.matvec_gguf_rows_kernel(x_value, data_value, forms, int8_activations=True)

    (out,) = run_fn(program, x, data)
    return out


def test_a_row_naming_no_k_quant_is_a_clear_error():
    """A Q5_0 row (per 32 values: the matrix-vector kernel's) among Q6_K ones, at the width rows
    of Q4_K and Q6_K have: the kernel names the problem when it runs."""
    data, _ = mixed_rows(["Q6_K", "Q5_0"], ("Q6_K", "Q5_0"), 256, 0)
    with pytest.raises(Exception, match="names no K-quant"):
        run_rows_gemm(np.ones((5, 256), np.float32), data, ("Q4_K", "Q6_K"))


def test_a_row_lying_past_the_rows_is_a_clear_error():
    """A K-quant row whose offset would run it into the offsets is refused, never read."""
    data, _ = mixed_rows(["Q6_K", "Q4_K"], ("Q4_K", "Q6_K"), 256, 0)
    body = data.shape[0] * (data.shape[1] - ROW_TAIL)
    data.reshape(-1)[body + 4:body + 8] = np.array([body - 100], "<u4").view(np.uint8)
    with pytest.raises(Exception, match="names no K-quant"):
        run_rows_gemm(np.ones((5, 256), np.float32), data, ("Q4_K", "Q6_K"))


# The forms of 32-value blocks: rows of 1 to 18 blocks (SmolLM2-135M's 576 values), activation
# rows around the tiles and up to a prompt's 130, weight rows around the panels of 32.
@pytest.mark.parametrize("ggml_type", linalg.GGUF_GEMM32_X8_KERNEL_TYPES)
@pytest.mark.parametrize("lead, n, k", [((1,), 5, 32), ((3,), 33, 576), ((6,), 17, 224), ((2, 7), 40, 96),
                                        ((130,), 67, 576)])
def test_each_gemm_of_32_value_blocks_matches_numpy(ggml_type, lead, n, k):
    x, data = random_operands(ggml_type, lead, n, 0, seed=sum(lead) * 7 + n + len(ggml_type), k=k)
    x.reshape(-1, k)[-1, k - 32:] = 0                  # a block of zero activations
    out = run_gemm(x, data, ggml_type)
    assert out.shape == (*lead, n) and out.dtype == np.float32
    check_int8_activation_product(out, x, [ggml_type] * n, data)


@pytest.mark.parametrize("ggml_type", linalg.GGUF_GEMM32_X8_KERNEL_TYPES)
def test_the_gemm_of_32_value_blocks_agrees_with_the_matvec_kernel(ggml_type):
    """Many panels, a prompt's rows: the same integer sums as the int8 matrix-vector kernel."""
    x, data = random_operands(ggml_type, (130,), 301, 0, seed=6, k=576)
    gemm = run_gemm(x, data, ggml_type)
    matvec = run_kernel(x, data, ggml_type, int8_activations=True)
    bound = np.abs(q8_1_rounded(x)[0]) @ np.abs(gguf_dequantized(ggml_type, data).astype(np.float64)).T
    assert (np.abs(gemm - matvec) <= 1e-5 * bound + 1e-30).all()


def test_q5_0_blocks_at_their_extremes_sum_without_overflow():
    """Every Q5_0 value at -16 (nibbles and high bits zero) against activations rounded to 127
    and -127: a block's 16-bit sums (8 quads of 2 * 16 * 127) stay within int16."""
    data = np.zeros((8, 18, 22), np.uint8)
    data[:, :, :2] = np.array([1.0], np.float16).view(np.uint8)
    data = data.reshape(8, 18 * 22)
    x = np.ones((9, 576), np.float32)
    x[1::2] = -1
    out = run_gemm(x, data, "Q5_0")
    # d_x is 1 / 127 kept as f16: the exact -16 * 576 to that rounding (a wrapped sum is far off).
    expected = np.where(x[:, :1] > 0, -16.0 * 576, 16.0 * 576) * np.ones((1, 8))
    np.testing.assert_allclose(out, expected, rtol=1e-4)
    check_int8_activation_product(out, x, ["Q5_0"] * 8, data)


# K-quants: Q4_K and Q6_K rows as llama.cpp's Q4_K_M mixes them, one of each form in a panel,
# every form (a scale per 16 values for all rows), and one form only (a scale per 32: Q4_K
# alone); rows of 512 values, room for Q6_K's. Forms of 32-value blocks: Q5_0 and Q8_0 rows as
# its Q4_K_M of a small model mixes them (attn_v), small weights only (|w| <= 16: sums over a
# whole block in int16), one form alone, and every form; rows of 576 values, room for Q8_0's.
MIXED_ROWS = [(["Q4_K", "Q6_K"] * 20 + ["Q6_K"], 512), (["Q6_K"] + ["Q4_K"] * 40, 512),
              (list(linalg.GGUF_GEMM_X8_KERNEL_TYPES) * 7, 512), (["Q4_K"] * 33, 512),
              (["Q5_0", "Q8_0"] * 20 + ["Q8_0"], 576), (["Q4_0", "Q5_0", "Q4_1"] * 11, 576),
              (["Q5_0"] * 33, 576), (list(linalg.GGUF_ROWS32_GEMM_X8_KERNEL_TYPES) * 7, 576)]


@pytest.mark.parametrize("types, k", MIXED_ROWS)
def test_the_gemm_of_rows_of_mixed_forms_matches_numpy_and_the_matvec_kernel(types, k):
    k_quants = set(types) <= set(linalg.GGUF_GEMM_X8_KERNEL_TYPES)
    forms = tuple(sorted(set(types) | {"Q6_K" if k_quants else "Q8_0"}))      # room for the widest form
    data, _ = mixed_rows(types, forms, k, seed=len(types))
    x = np.random.default_rng(len(types)).standard_normal((13, k)).astype(np.float32)
    out = run_rows_gemm(x, data, forms)
    assert out.shape == (13, len(types))
    check_int8_activation_product(out, x, types, data, mixed=True)
    matvec = run_rows_gemm(x, data, forms, gemm=False)
    w = np.concatenate([gguf_dequantized(t, row[None]) for t, row in unpack_mixed_rows(data, k)])
    rounded = q8_k_rounded(x) if k_quants else q8_1_rounded(x)[0]
    bound = np.abs(rounded) @ np.abs(w.astype(np.float64)).T
    assert (np.abs(out - matvec) <= 1e-5 * bound + 1e-30).all()


def test_a_row_naming_no_32_value_block_form_is_a_clear_error():
    """A Q4_K row among Q5_0 ones, at the width the rows have: named when the kernel runs."""
    data, _ = mixed_rows(["Q5_0", "Q4_K"], ("Q5_0", "Q4_K"), 256, 0)
    with pytest.raises(Exception, match="names no form of 32-value blocks"):
        run_rows_gemm(np.ones((9, 256), np.float32), data, ("Q5_0",))


def test_the_gemm_refuses_forms_and_shapes_it_cannot_run():
    def build(x_shape, data_shape, ggml_type):
        def program(scribe):
            return linalg.gemm_gguf_x8_kernel(scribe.f32[x_shape].Parameter(parameter_number=0),
                                              scribe.u8[data_shape].Parameter(parameter_number=1), ggml_type)
        return program

    with pytest.raises(HloShapeError, match="gemm_gguf_x8_kernel: .*got IQ4_XS"):
        compile_py_func(build((8, 256), (4, 136), "IQ4_XS"))     # no GEMM for IQ4_XS
    with pytest.raises(HloShapeError, match="gemm_gguf_x8_kernel: .*got Q4_K"):
        compile_py_func(build((8, 256), (4, 150), "Q4_K"))       # a partial super-block
    with pytest.raises(HloShapeError, match="gemm_gguf_x8_kernel: .*got Q5_0"):
        compile_py_func(build((8, 64), (4, 40), "Q5_0"))         # a partial block
    with pytest.raises(HloShapeError, match="rows of Q4_K/Q5_0: the GEMM takes rows of"):
        compile_py_func(lambda scribe: linalg.gemm_gguf_rows_x8_kernel(
            scribe.f32[8, 256].Parameter(parameter_number=0), scribe.u8[4, 177].Parameter(parameter_number=1),
            ("Q4_K", "Q5_0")))
    assert set(cpu_kernels.GEMM_GGUF_X8_TARGETS) == set(linalg.GGUF_GEMM_X8_KERNEL_TYPES)
    assert set(cpu_kernels.GEMM_GGUF32_X8_TARGETS) == set(linalg.GGUF_GEMM32_X8_KERNEL_TYPES)


@pytest.mark.parametrize("flags", ["-mno-avx512f", "-mno-avx512f -mno-avx2"], ids=["avx2", "portable"])
def test_the_avx2_and_portable_forms_of_the_gemm_match_numpy(flags):
    """The kernels built without AVX-512 (the AVX2 form of the GEMM, on an x86 host with AVX2)
    and without AVX2 as well (its portable form) pass this file's checks."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYHLO_KERNEL_FLAGS=flags, PYTHONPATH=python_path(here.parent))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           str(here / "test_cpu_kernels_gguf_gemm.py"), "-k", "not avx2_and_portable"],
                          env=env, capture_output=True, text=True, timeout=900, cwd=here.parent)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout
