"""pyhlo's matrix-vector kernels on weights kept as a GGUF file stores them (Q5_0, Q5_1, the
K-quants, IQ4_NL, IQ4_XS) equal numpy on the gguf package's dequantization of the same blocks,
at 1-8 activation rows, in every instruction-set form the host builds; the int8-activation
kernels equal numpy on the activations rounded as llama.cpp rounds them for each form (Q8_K per
256 values for the K-quants and IQ4_XS, Q8_0 / Q8_1 per 32 for the others), rows of mixed forms
each row as its form."""
from __future__ import annotations

import numpy as np
import pytest
from child_env import python_path
from hlo_run import run_fn
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_gguf_kquant_blocks import gguf_dequantized, mixed_rows, random_gguf_blocks, random_rows

from pyhlo.ops import linalg
from pyhlo.ops.gguf_blocks import LAYOUTS, ROW_CODES, ROW_TAIL, pack_mixed_rows, row_bytes, unpack_mixed_rows
from pyhlo.shape_inference import HloShapeError
from runtime import cpu_kernels

pytestmark = pytest.mark.cpu_only


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert cpu_kernels.register(), "the CPU kernels did not build"


def run_kernel(x: np.ndarray, data: np.ndarray, ggml_type: str, int8_activations: bool = False,
               gemm: bool = False) -> np.ndarray:
    def program(scribe):
        return linalg.matvec_gguf_kernel(scribe.f32[x.shape].Parameter(parameter_number=0),
                                         scribe.u8[data.shape].Parameter(parameter_number=1), ggml_type,
                                         int8_activations=int8_activations, gemm=gemm)

    (out,) = run_fn(program, x, data)
    return out


def run_rows_kernel(x: np.ndarray, data: np.ndarray, forms: tuple[str, ...], **options) -> np.ndarray:
    """matvec_gguf_rows_kernel over rows of mixed forms (options: int8_activations, gemm)."""
    def program(scribe):
        return linalg.matvec_gguf_rows_kernel(scribe.f32[x.shape].Parameter(parameter_number=0),
                                              scribe.u8[data.shape].Parameter(parameter_number=1), forms,
                                              **options)

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


# The exact prefill GEMM (gemm=True): the same check at row counts past its tiles of 12 rows,
# weight rows past its panels of 32 and k past its chunks of 1024 values.
@pytest.mark.parametrize("ggml_type", linalg.GGUF_KERNEL_TYPES)
@settings(max_examples=4, deadline=None)
@given(lead=st.sampled_from([(1,), (13,), (25,), (2, 7)]), n=st.sampled_from([1, 17, 33, 70]),
       blocks=st.sampled_from([1, 5]), seed=st.integers(0, 2**32 - 1))
def test_each_exact_gguf_gemm_kernel_matches_numpy(ggml_type, lead, n, blocks, seed):
    data = random_gguf_blocks(ggml_type, n, blocks * (8 if LAYOUTS[ggml_type][0] == 32 else 1), seed)
    w = gguf_dequantized(ggml_type, data).astype(np.float64)
    x = np.random.default_rng(seed + 1).standard_normal((*lead, w.shape[1])).astype(np.float32)
    out = run_kernel(x, data, ggml_type, gemm=True)
    bound = np.abs(x).astype(np.float64) @ np.abs(w).T
    assert out.shape == (*lead, n) and out.dtype == np.float32
    assert (np.abs(out - x.astype(np.float64) @ w.T) <= 1e-5 * bound + 1e-30).all()


@settings(max_examples=10, deadline=None)
@given(types=st.lists(st.sampled_from(["Q4_K", "Q6_K", "Q5_0", "Q8_0", "Q4_0", "Q4_1", "Q5_1"]), min_size=1,
                      max_size=40),
       lead=st.sampled_from([(1,), (13,)]), seed=st.integers(0, 2**32 - 1))
def test_the_exact_gemm_of_rows_of_mixed_forms_matches_numpy(types, lead, seed):
    forms = tuple(sorted(set(types)))
    data, w = mixed_rows(types, forms, 1280, seed)
    x = np.random.default_rng(seed + 1).standard_normal((*lead, 1280)).astype(np.float32)
    out = run_rows_kernel(x, data, forms, gemm=True)
    w = w.astype(np.float64)
    bound = np.abs(x).astype(np.float64) @ np.abs(w).T
    assert out.shape == (*lead, len(types))
    assert (np.abs(out - x.astype(np.float64) @ w.T) <= 1e-5 * bound + 1e-30).all()


@settings(max_examples=15, deadline=None)
@given(types=st.lists(st.sampled_from(["Q4_K", "Q6_K", "Q5_0", "Q8_0", "Q4_0", "Q4_1", "Q5_1"]), min_size=1,
                      max_size=9),
       lead=st.sampled_from([(1,), (3,), (8,)]), seed=st.integers(0, 2**32 - 1))
def test_the_kernel_of_rows_of_mixed_forms_matches_numpy(types, lead, seed):
    forms = tuple(sorted(set(types)))
    data, w = mixed_rows(types, forms, 512, seed)
    x = np.random.default_rng(seed + 1).standard_normal((*lead, 512)).astype(np.float32)
    out = run_rows_kernel(x, data, forms)
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


# Forms whose int8-activation kernels round x per 32 values (llama.cpp's vec_dot_type q8_0, or
# q8_1 for Q5_1 and Q4_1, whose minimum meets the kept sum s); the others per 256 (q8_K).
PER_32_TYPES = ("Q5_0", "Q5_1", "IQ4_NL", "Q8_0", "Q4_0", "Q4_1")
WITH_MINIMUMS = ("Q5_1", "Q4_1")      # a block: f16 d, f16 m, ...


def q8_1_rounded(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x rounded per 32 values as llama.cpp's x86 quantize_row_q8_1 rounds it (quantize_row_q8_0
    gives the same q and d): amax = max |x|, d = amax / 127 kept as f16, q = round(x * (127 /
    amax)) (an f32 product, ties to even), s = d * sum q (d before its f16 rounding) kept as f16.
    Returned as d * q, and per block s and d * sum q, the kept sum and the one it stands for."""
    blocks = x.reshape(*x.shape[:-1], -1, 32).astype(np.float32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    d = amax / np.float32(127)
    inverse = np.where(amax != 0, np.float32(127) / np.where(amax != 0, amax, 1), 0).astype(np.float32)
    q = np.rint(blocks * inverse)
    total = q.sum(axis=-1, keepdims=True)
    d16 = d.astype(np.float16).astype(np.float64)
    s16 = (d * total).astype(np.float16).astype(np.float64)
    return (d16 * q).reshape(x.shape), s16[..., 0], (d16 * total)[..., 0]


def int8_activation_product(x: np.ndarray, ggml_type: str, data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's product of x with weight rows `data` of `ggml_type`, x rounded as its
    vec_dot_type for the form rounds it; and the size of the sum's terms."""
    w = gguf_dequantized(ggml_type, data).astype(np.float64)
    if ggml_type not in PER_32_TYPES:
        rounded = q8_k_rounded(x)
        return rounded @ w.T, np.abs(rounded) @ np.abs(w).T
    rounded, kept_sum, exact_sum = q8_1_rounded(x)
    product, bound = rounded @ w.T, np.abs(rounded) @ np.abs(w).T
    if ggml_type in WITH_MINIMUMS:       # m * s: the minimum's term takes the kept f16 sum
        size = LAYOUTS[ggml_type][1]
        mins = data.reshape(len(data), -1, size)[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        product = product + (kept_sum - exact_sum) @ mins.T
        bound = bound + np.abs(kept_sum) @ np.abs(mins).T
    return product, bound


def check_int8_activation_product(out: np.ndarray, x: np.ndarray, types: list[str], data: np.ndarray,
                                  mixed: bool = False) -> None:
    """Each weight row's product as llama.cpp computes it for the row's form (types[i] for row
    i of data; `mixed`: data is rows of mixed forms, pack_mixed_rows), to f32 rounding; and
    within the rounding's reach of the exact product."""
    k = x.shape[-1]
    expected, bound = np.zeros(out.shape), np.zeros(out.shape)
    w = np.zeros((len(types), k))
    each = unpack_mixed_rows(data, k) if mixed else None
    for ggml_type in set(types):
        rows = np.array([t == ggml_type for t in types])
        part = (np.stack([r for (t, r) in each if t == ggml_type]) if each is not None
                else np.ascontiguousarray(data[rows, :row_bytes(ggml_type, k)]))
        expected[..., rows], bound[..., rows] = int8_activation_product(x, ggml_type, part)
        w[rows] = gguf_dequantized(ggml_type, part)
    assert (np.abs(out - expected) <= 1e-5 * bound + 1e-30).all()
    exact_bound = np.abs(x).astype(np.float64) @ np.abs(w).T
    assert (np.abs(out - x.astype(np.float64) @ w.T) <= 0.01 * exact_bound + 1e-30).all()


def run_rows_kernel_x8(x: np.ndarray, data: np.ndarray, forms: tuple[str, ...]) -> np.ndarray:
    """The int8-activation kernel over rows of mixed forms (each row's form in its last byte)."""
    return run_rows_kernel(x, data, forms, int8_activations=True)


def test_q8_1_rounding_is_llama_cpps():
    """The per-32 reference rounding against numbers worked by hand: the scale from the largest
    magnitude, ties to even, d and s kept as f16, a block of zeros zero."""
    x = np.zeros((1, 64), np.float32)
    x[0, :5] = [-127.0, 0.5, 1.5, 2.5, 100.25]   # amax 127: q = round(x), d = 1
    rounded, kept_sum, exact_sum = q8_1_rounded(x)
    np.testing.assert_array_equal(rounded[0, :5], [-127.0, 0.0, 2.0, 2.0, 100.0])
    np.testing.assert_array_equal(kept_sum, [[-23.0, 0.0]])
    np.testing.assert_array_equal(exact_sum, [[-23.0, 0.0]])
    x[0, 32] = 1000.0             # d = 1000 / 127 = 7.874..., as f16 7.875; s = d * 127 = 1000
    rounded, kept_sum, _ = q8_1_rounded(x)
    assert rounded[0, 32] == 7.875 * 127 and kept_sum[0, 1] == 1000.0


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
    blocks = 9 if rows % 2 else 2                  # of 256 values
    data = random_gguf_blocks(ggml_type, 2 * rows + 3, blocks * 256 // LAYOUTS[ggml_type][0], seed)
    x = np.random.default_rng(seed + 1).standard_normal((rows, 256 * blocks)).astype(np.float32)
    x[0, 256:512] = 0
    out = run_kernel(x, data, ggml_type, int8_activations=True)
    assert out.shape == (rows, 2 * rows + 3) and out.dtype == np.float32
    check_int8_activation_product(out, x, [ggml_type] * len(data), data)


# The K-quants' decode kernels unpack each super-block in registers for up to 8 activation rows
# at a time: every count of rows in a pass, passes of 8 and the rest, at an odd number of
# super-blocks and of weight rows.
@pytest.mark.parametrize("ggml_type", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("rows", [2, 4, 6, 8, 9, 12, 17])
def test_k_quant_int8_activation_kernels_at_every_count_of_rows_match_numpy(ggml_type, rows):
    seed = 10 * rows + len(ggml_type)
    data = random_gguf_blocks(ggml_type, 7, 5, seed)       # K = 5 * 256
    x = np.random.default_rng(seed + 1).standard_normal((rows, 5 * 256)).astype(np.float32)
    x[-1, 512:768] = 0
    out = run_kernel(x, data, ggml_type, int8_activations=True)
    assert out.shape == (rows, 7)
    check_int8_activation_product(out, x, [ggml_type] * len(data), data)


@pytest.mark.parametrize("rows", [1, 8, 11])
def test_k_quant_rows_of_mixed_forms_past_eight_activation_rows_match_numpy(rows):
    """Rows of the K-quants among others (a Q4_K_M file's fused q|k|v), 1 to 11 activation rows."""
    types = ["Q4_K", "Q6_K", "Q8_0", "Q5_K", "Q4_K", "Q6_K", "Q5_0"]
    forms = tuple(sorted(set(types)))
    data, _ = mixed_rows(types, forms, 768, rows)
    x = np.random.default_rng(rows).standard_normal((rows, 768)).astype(np.float32)

    check_int8_activation_product(run_rows_kernel_x8(x, data, forms), x, types, data, mixed=True)


@settings(max_examples=10, deadline=None)
@given(ggml_type=st.sampled_from(linalg.GGUF_X8_KERNEL_TYPES),
       lead=st.sampled_from([(1,), (4,), (7,), (2, 3)]), n=st.integers(1, 40), blocks=st.integers(1, 10),
       scale=st.sampled_from([1e-3, 1.0, 30.0]),
       seed=st.integers(0, 2**32 - 1))
def test_int8_activation_gguf_kernels_at_any_shape_matches_numpy(ggml_type, lead, n, blocks, scale, seed):
    data = random_gguf_blocks(ggml_type, n, blocks * 256 // LAYOUTS[ggml_type][0], seed)
    x = (scale * np.random.default_rng(seed + 1).standard_normal((*lead, 256 * blocks))).astype(np.float32)
    out = run_kernel(x, data, ggml_type, int8_activations=True)
    check_int8_activation_product(out, x, [ggml_type] * n, data)


@settings(max_examples=15, deadline=None)
@given(types=st.lists(st.sampled_from(list(linalg.GGUF_ROWS_X8_KERNEL_TYPES)), min_size=1, max_size=9),
       lead=st.sampled_from([(1,), (3,), (8,)]), seed=st.integers(0, 2**32 - 1))
# A product iscale * x that, fused into an FMA with the rounding's addition, rounded the other way.
@example(types=["Q2_K"], lead=(3,), seed=70555)
def test_the_int8_activation_kernel_of_rows_of_mixed_forms_matches_numpy(types, lead, seed):
    """Rows of per-32 forms (Q8_0, Q5_0 ...) among K-quants, as a Q4_K_M file's fused q|k|v: x
    rounded both ways, each row multiplied as its form is."""
    forms = tuple(sorted(set(types)))
    data, _ = mixed_rows(types, forms, 512, seed)
    x = np.random.default_rng(seed + 1).standard_normal((*lead, 512)).astype(np.float32)
    out = run_rows_kernel(x, data, forms, int8_activations=True)
    assert out.shape == (*lead, len(types))
    check_int8_activation_product(out, x, types, data, mixed=True)


@pytest.mark.parametrize("types", [["Q5_1"] * 3, ["Q4_1", "Q5_1", "Q4_K", "Q4_1"]])
def test_minimums_meet_the_kept_f16_sums_of_the_rounded_activations_matches_numpy(types):
    """Q5_1 and Q4_1 blocks with d = 0 are their minimums alone: the product is then sum_b m * s,
    which tells llama.cpp's kept f16 s from the d * sum q it stands for (about 1e-4 apart)."""
    forms = tuple(sorted(set(types)))
    rows = random_rows(types, 512, 7)
    for ggml_type, row in rows:
        if ggml_type in WITH_MINIMUMS:
            row.reshape(16, LAYOUTS[ggml_type][1])[:, :2] = 0
    x = np.random.default_rng(8).standard_normal((2, 512)).astype(np.float32)
    if len(forms) == 1:
        data = np.concatenate([row for _, row in rows])
        out = run_kernel(x, data, forms[0], int8_activations=True)
    else:
        data = pack_mixed_rows(rows, 512, forms)
        out = run_rows_kernel_x8(x, data, forms)
    check_int8_activation_product(out, x, types, data, mixed=len(forms) > 1)


def test_every_form_kept_as_stored_has_an_int8_activation_kernel():
    """Every GGML type with a kernel on the file's bytes has its _x8 form, rows of mixed forms
    every row code; a form outside that list is refused by name."""
    assert set(linalg.GGUF_X8_KERNEL_TYPES) == set(linalg.GGUF_KERNEL_TYPES)
    assert set(linalg.GGUF_ROWS_X8_KERNEL_TYPES) == set(ROW_CODES)
    assert set(cpu_kernels.MATVEC_GGUF_X8_TARGETS) == set(linalg.GGUF_X8_KERNEL_TYPES)
    with pytest.raises(HloShapeError, match="no int8-activation kernel for Q4_K/BF16"):
        linalg._gguf_target("matvec_gguf_rows_kernel", True, ("Q4_K", "BF16"))


@pytest.mark.parametrize("kernel", ["exact", "int8", "gemm"])
@pytest.mark.parametrize("spoil", ["code", "offset"])
def test_a_row_naming_no_form_or_lying_past_the_rows_is_a_clear_error(spoil, kernel):
    """A code outside ROW_CODES, or an offset whose row would run past the rows' bytes (into
    the offsets, or out of the array), is refused when the kernel runs, never read."""
    data, _ = mixed_rows(["Q4_K", "Q6_K"], ("Q4_K", "Q6_K"), 256, 0)
    flat = data.reshape(-1)
    if spoil == "code":
        flat[-1] = 200
    else:
        body = data.shape[0] * (data.shape[1] - ROW_TAIL)
        flat[body + 4:body + 8] = np.array([body - 100], "<u4").view(np.uint8)   # row 1: Q6_K, 210 bytes
    x = np.ones((1, 256), np.float32)

    def program(scribe):
        return linalg.matvec_gguf_rows_kernel(scribe.f32[x.shape].Parameter(parameter_number=0),
                                              scribe.u8[data.shape].Parameter(parameter_number=1),
                                              ("Q4_K", "Q6_K"), int8_activations=kernel == "int8",
                                              gemm=kernel == "gemm")

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
