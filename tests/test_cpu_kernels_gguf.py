"""pyhlo's matrix-vector kernels on weights kept as a GGUF file stores them (Q5_0, Q5_1, the
K-quants, IQ4_NL, IQ4_XS) equal numpy on the gguf package's dequantization of the same blocks,
at 1-8 activation rows, in every instruction-set form the host builds."""
from __future__ import annotations

import numpy as np
import pytest
from hlo_run import run_fn
from hypothesis import given, settings
from hypothesis import strategies as st
from test_gguf_kquant_blocks import gguf_dequantized, random_gguf_blocks

from pyhlo.ops import linalg
from pyhlo.ops.gguf_blocks import LAYOUTS
from pyhlo.shape_inference import HloShapeError
from runtime import cpu_kernels

pytestmark = pytest.mark.cpu_only


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert cpu_kernels.register(), "the CPU kernels did not build"


def run_kernel(x: np.ndarray, data: np.ndarray, ggml_type: str) -> np.ndarray:
    def program(scribe):
        return linalg.matvec_gguf_kernel(scribe.f32[x.shape].Parameter(parameter_number=0),
                                         scribe.u8[data.shape].Parameter(parameter_number=1), ggml_type)

    (out,) = run_fn(program, x, data)
    return out


# n covers the thread chunks and their tails; rows 1-8 and a 2-d lead.
@pytest.mark.parametrize("ggml_type", sorted(LAYOUTS))
@settings(max_examples=6, deadline=None)
@given(lead=st.sampled_from([(1,), (3,), (4,), (5,), (8,), (2, 3)]), n=st.integers(1, 40),
       blocks=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_gguf_kernels_match_numpy(ggml_type, lead, n, blocks, seed):
    data = random_gguf_blocks(ggml_type, n, blocks, seed)
    w = gguf_dequantized(ggml_type, data).astype(np.float64)
    x = np.random.default_rng(seed + 1).standard_normal((*lead, w.shape[1])).astype(np.float32)
    out = run_kernel(x, data, ggml_type)
    expected = x.astype(np.float64) @ w.T
    bound = np.abs(x).astype(np.float64) @ np.abs(w).T         # the size of the sum's terms
    assert out.shape == (*lead, n) and out.dtype == np.float32
    assert (np.abs(out - expected) <= 1e-5 * bound + 1e-30).all()


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
    env = dict(os.environ, PYHLO_KERNEL_FLAGS=KERNEL_FORMS[form], PYTHONPATH=str(here.parent))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           str(here / "test_cpu_kernels_gguf.py"),
                           "-k", "match_numpy and not instruction_set"],
                          env=env, capture_output=True, text=True, timeout=900, cwd=here.parent)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout
