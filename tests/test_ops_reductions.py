"""Reductions and contractions against numpy: sum/max/min, argmax, cumulative sum, dot products."""
from __future__ import annotations

import numpy as np
from hlo_run import run_fn
from hypothesis import given, settings
from hypothesis import strategies as st

from pyhlo.dtypes import numpy_dtype
from pyhlo.ops import linalg, reductions

BF16 = numpy_dtype("bf16")
SETTINGS = settings(max_examples=15, deadline=None)
shapes = st.lists(st.integers(1, 6), min_size=1, max_size=4).map(tuple)
seeds = st.integers(0, 2**32 - 1)


def _param(scribe, dtype, dims, n=0):
    return getattr(scribe, dtype)[tuple(dims)].Parameter(parameter_number=n)


@SETTINGS
@given(dims=shapes, seed=seeds, keep_dims=st.booleans(), data=st.data())
def test_sum_max_min_f32(dims, seed, keep_dims, data):
    axes = data.draw(st.lists(st.integers(-len(dims), len(dims) - 1), min_size=1, max_size=len(dims),
                              unique_by=lambda d: d % len(dims)))
    x = np.random.default_rng(seed).standard_normal(dims).astype(np.float32)

    def program(scribe):
        a = _param(scribe, "f32", dims)
        return [reductions.reduce_sum(a, axes, keep_dims), reductions.reduce_max(a, axes, keep_dims),
                reductions.reduce_min(a, axes, keep_dims)]

    total, largest, smallest = run_fn(program, x)
    axis = tuple(d % len(dims) for d in axes)
    np.testing.assert_allclose(total, x.sum(axis=axis, keepdims=keep_dims), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(largest, x.max(axis=axis, keepdims=keep_dims))
    np.testing.assert_array_equal(smallest, x.min(axis=axis, keepdims=keep_dims))


@SETTINGS
@given(dims=shapes, seed=seeds)
def test_sum_max_min_bf16_over_the_last_dim(dims, seed):
    x = np.random.default_rng(seed).standard_normal(dims).astype(BF16)

    def program(scribe):
        a = _param(scribe, "bf16", dims)
        return [reductions.reduce_sum(a, -1), reductions.reduce_max(a, -1), reductions.reduce_min(a, -1)]

    total, largest, smallest = run_fn(program, x)
    x32 = x.astype(np.float32)
    # At most 6 terms, each partial sum rounded to bf16: a few bf16 ulps of the largest term.
    np.testing.assert_allclose(total.astype(np.float32), x32.sum(-1), rtol=2e-2, atol=3e-2)
    np.testing.assert_array_equal(largest, x.max(-1))
    np.testing.assert_array_equal(smallest, x.min(-1))


@SETTINGS
@given(dims=shapes, seed=seeds, dtype=st.sampled_from(["s32", "s8", "u8", "s16", "u16", "u32"]))
def test_integer_reductions(dims, seed, dtype):
    info = np.iinfo(numpy_dtype(dtype))
    x = np.random.default_rng(seed).integers(max(info.min, -50), min(info.max, 50), dims, endpoint=True)
    x = x.astype(numpy_dtype(dtype))

    def program(scribe):
        a = _param(scribe, dtype, dims)
        return [reductions.reduce_max(a, 0), reductions.reduce_min(a, 0)]

    largest, smallest = run_fn(program, x)
    np.testing.assert_array_equal(largest, x.max(0))
    np.testing.assert_array_equal(smallest, x.min(0))


def test_max_and_min_keep_the_type_extremes():
    values = {"s8": [-128, 127], "u8": [0, 255], "s16": [-(2**15), 2**15 - 1], "u16": [0, 2**16 - 1],
              "s32": [-(2**31), 2**31 - 1], "u32": [0, 2**32 - 1],
              "f16": [-np.inf, np.inf], "f32": [-np.inf, np.inf], "bf16": [-np.inf, np.inf]}
    arrays = [np.array(v, dtype=numpy_dtype(t)) for t, v in values.items()]

    def program(scribe):
        outs = []
        for i, (dtype, _) in enumerate(values.items()):
            a = _param(scribe, dtype, (2,), i)
            outs += [reductions.reduce_max(a, 0), reductions.reduce_min(a, 0)]
        return outs

    outs = run_fn(program, *arrays)
    for i, array in enumerate(arrays):
        assert outs[2 * i] == array.max() and outs[2 * i + 1] == array.min(), array.dtype


@SETTINGS
@given(dims=shapes, seed=seeds, dtype=st.sampled_from(["f32", "bf16", "s32"]), data=st.data())
def test_argmax_ties_go_to_the_smallest_index(dims, seed, dtype, data):
    dim = data.draw(st.integers(-len(dims), len(dims) - 1))
    # Three distinct values: ties are common.
    x = np.random.default_rng(seed).integers(-1, 2, dims).astype(numpy_dtype(dtype))

    def program(scribe):
        a = _param(scribe, dtype, dims)
        return [reductions.argmax(a, dim), reductions.argmax(a, dim, keep_dims=True)]

    index, kept = run_fn(program, x)
    assert index.dtype == np.int32
    np.testing.assert_array_equal(index, np.argmax(x, axis=dim))  # numpy also picks the first maximum
    np.testing.assert_array_equal(kept, np.expand_dims(np.argmax(x, axis=dim), dim))


def test_argmax_of_all_lowest_values():
    x = np.full((2, 3), -np.inf, np.float32)
    (index,) = run_fn(lambda scribe: reductions.argmax(_param(scribe, "f32", (2, 3)), 1), x)
    assert index.tolist() == [0, 0]


@SETTINGS
@given(dims=shapes, seed=seeds, dtype=st.sampled_from(["f32", "s32"]), data=st.data())
def test_cumsum(dims, seed, dtype, data):
    dim = data.draw(st.integers(-len(dims), len(dims) - 1))
    x = np.random.default_rng(seed).integers(-5, 6, dims).astype(numpy_dtype(dtype))
    (out,) = run_fn(lambda scribe: reductions.cumsum(_param(scribe, dtype, dims), dim), x)
    np.testing.assert_array_equal(out, np.cumsum(x, axis=dim).astype(x.dtype))


# -- contractions (pyhlo.ops.linalg) ----------------------------------------------

@SETTINGS
@given(batch=st.lists(st.integers(1, 3), max_size=2), m=st.integers(1, 6), k=st.integers(1, 6),
       n=st.integers(1, 6), seed=seeds)
def test_dot_general_with_batch_dims(batch, m, k, n, seed):
    rng = np.random.default_rng(seed)
    # lhs [batch..., k, m] and rhs [batch..., n, k]: contracting dims that are not last or first.
    lhs = rng.standard_normal((*batch, k, m)).astype(np.float32)
    rhs = rng.standard_normal((*batch, n, k)).astype(np.float32)
    nb = len(batch)

    def program(scribe):
        a, b = _param(scribe, "f32", lhs.shape, 0), _param(scribe, "f32", rhs.shape, 1)
        return linalg.dot_general(a, b, ([nb], [nb + 1]), (list(range(nb)), list(range(nb))))

    (out,) = run_fn(program, lhs, rhs)
    np.testing.assert_allclose(out, np.einsum("...km,...nk->...mn", lhs, rhs), rtol=1e-5, atol=1e-5)


@SETTINGS
@given(lead=st.lists(st.integers(1, 4), min_size=1, max_size=2), k=st.integers(1, 6), n=st.integers(1, 6),
       seed=seeds)
def test_matmul_and_matmul_transposed(lead, k, n, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((*lead, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)

    def program(scribe):
        a = _param(scribe, "f32", x.shape, 0)
        w_in_out = _param(scribe, "f32", w.shape, 1)
        w_out_in = _param(scribe, "f32", w.T.shape, 2)
        return [linalg.matmul(a, w_in_out), linalg.matmul_transposed(a, w_out_in)]

    out, out_t = run_fn(program, x, w, np.ascontiguousarray(w.T))
    np.testing.assert_allclose(out, x @ w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out_t, x @ w, rtol=1e-5, atol=1e-5)


@SETTINGS
@given(m=st.integers(1, 6), k=st.integers(1, 6), n=st.integers(1, 6), seed=seeds)
def test_bf16_matmul_accumulates_into_f32(m, k, n, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(BF16)
    w = rng.standard_normal((k, n)).astype(BF16)

    def program(scribe):
        a, b = _param(scribe, "bf16", (m, k), 0), _param(scribe, "bf16", (k, n), 1)
        return [linalg.matmul(a, b, out_dtype="f32"), linalg.matmul(a, b)]

    wide, narrow = run_fn(program, x, w)
    exact = x.astype(np.float32) @ w.astype(np.float32)
    assert wide.dtype == np.float32 and narrow.dtype == BF16
    np.testing.assert_allclose(wide, exact, rtol=1e-5, atol=1e-5)  # bf16 products are exact in f32
    np.testing.assert_allclose(narrow.astype(np.float32), exact, rtol=1e-2, atol=2e-2)


def test_reduce_window_with_base_dilation():
    """The scribe's shape rule counts the holes that base dilation puts between elements."""
    x = np.array([1.0, 2.0, 3.0], np.float32)

    def program(scribe):
        a = _param(scribe, "f32", (3,))
        window = dict(dimensions=[dict(size=2, stride=1, base_dilation=2, window_dilation=1)])
        # [1, 2, 3] dilated is [1, 0, 2, 0, 3]: four windows of two.
        return scribe.f32[4].ReduceWindow(a, scribe.f32.Constant(constant_value=0.0), window=window,
                                          to_apply=reductions.scalar_computation("f32", "Add"))

    (out,) = run_fn(program, x)
    np.testing.assert_array_equal(out, [1.0, 2.0, 2.0, 3.0])
