"""Packed int8 rows (the quantized KV cache's form): the program's quantization and
dequantization equal numpy's."""
from __future__ import annotations

import numpy as np
import pytest
from hlo_run import run_fn
from hypothesis import given, settings
from hypothesis import strategies as st

from pyhlo.ops import elementwise as ew
from pyhlo.ops.quantized import dequantize_rows, quantize_rows
from pyhlo.shape_inference import HloShapeError


def numpy_quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(q s8 [..., d], scale f32 [...]) as quantize_rows defines them."""
    scale = np.abs(x).max(axis=-1) * np.float32(1 / 127)
    scale[scale == 0] = 1
    q = np.clip(np.rint(x * (np.float32(1) / scale)[..., None]), -127, 127).astype(np.int8)
    return q, scale


def rows_of(dims: tuple[int, ...], spread: float, zero_rows: bool, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(dims) * spread).astype(np.float32)
    if zero_rows:
        x[..., 0, :] = 0
    return x


@settings(max_examples=25, deadline=None)
@given(dims=st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple), d=st.integers(1, 80),
       spread=st.sampled_from([1e-3, 1.0, 300.0]), zero_rows=st.booleans(), seed=st.integers(0, 2**31))
def test_quantize_then_dequantize_rows_equals_numpy(dims, d, spread, zero_rows, seed):
    x = rows_of((*dims, d), spread, zero_rows, seed)

    def program(scribe):
        source = scribe.f32[x.shape].Parameter(parameter_number=0)
        packed = quantize_rows(source)
        return [packed, dequantize_rows(packed, "f32")]

    packed, back = run_fn(program, x)
    q, scale = numpy_quantize_rows(x)
    assert packed.dtype == np.int8 and packed.shape == (*dims, d + 4)
    np.testing.assert_array_equal(packed[..., :d], q)
    np.testing.assert_array_equal(np.ascontiguousarray(packed[..., d:]).view(np.float32)[..., 0], scale)
    np.testing.assert_array_equal(back, q.astype(np.float32) * scale[..., None])
    # Every value is within half a step of the original.
    assert np.all(np.abs(back - x) <= scale[..., None] * np.float32(0.5 + 1e-5))


def test_rows_of_zeros_keep_scale_one_and_bf16_rows_are_widened_first():
    import ml_dtypes

    x = np.zeros((3, 8), np.float32)
    x[1:] = np.random.default_rng(0).standard_normal((2, 8))
    x = x.astype(ml_dtypes.bfloat16).astype(np.float32)

    def program(scribe):
        source = scribe.f32[x.shape].Parameter(parameter_number=0)
        return [quantize_rows(source), quantize_rows(ew.convert(source, "bf16"))]

    from_f32, from_bf16 = run_fn(program, x)
    np.testing.assert_array_equal(from_f32, from_bf16)
    assert np.all(from_f32[0, :8] == 0) and np.ascontiguousarray(from_f32[0, 8:]).view(np.float32)[0] == 1
    q, scale = numpy_quantize_rows(x)
    np.testing.assert_array_equal(from_f32[:, :8], q)


def test_dequantize_rows_refuses_what_is_not_packed():
    def program(scribe):
        return dequantize_rows(scribe.f32[2, 8].Parameter(parameter_number=0))

    with pytest.raises(HloShapeError, match="packed rows"):
        run_fn(program, np.zeros((2, 8), np.float32))
