"""Data movement ops against numpy: reshape, transpose, broadcast, slices, concatenation, padding, iota."""
from __future__ import annotations

import numpy as np
from hlo_run import run_fn
from hypothesis import given, settings
from hypothesis import strategies as st

from pyhlo.dtypes import numpy_dtype
from pyhlo.ops import shape_ops as so
from pyhlo.ops.elementwise import constant

SETTINGS = settings(max_examples=15, deadline=None)
shapes = st.lists(st.integers(1, 6), min_size=1, max_size=4).map(tuple)
dtypes = st.sampled_from(["f32", "bf16", "s32"])


def _param(scribe, dtype, dims, n=0):
    return getattr(scribe, dtype)[tuple(dims)].Parameter(parameter_number=n)


def _array(dims, dtype, seed=0):
    values = np.random.default_rng(seed).integers(-100, 100, dims)
    return values.astype(numpy_dtype(dtype))  # small integers: exact in every type


@SETTINGS
@given(dims=shapes, dtype=dtypes, data=st.data())
def test_reshape(dims, dtype, data):
    x = _array(dims, dtype)
    # Any factorization of the element count, of a random rank.
    size, new = x.size, []
    for _ in range(data.draw(st.integers(0, 3))):
        divisors = [d for d in range(1, size + 1) if size % d == 0]
        new.append(data.draw(st.sampled_from(divisors)))
        size //= new[-1]
    new.append(size)

    (out,) = run_fn(lambda scribe: so.reshape(_param(scribe, dtype, dims), new), x)
    np.testing.assert_array_equal(out, x.reshape(new))


@SETTINGS
@given(dims=shapes, dtype=dtypes, data=st.data())
def test_transpose(dims, dtype, data):
    x = _array(dims, dtype)
    permutation = data.draw(st.permutations(range(len(dims))))
    (out,) = run_fn(lambda scribe: so.transpose(_param(scribe, dtype, dims), permutation), x)
    np.testing.assert_array_equal(out, x.transpose(permutation))


@SETTINGS
@given(dims=shapes, dtype=dtypes, data=st.data())
def test_broadcast(dims, dtype, data):
    # Put the operand's dims, in order, among new ones of random sizes.
    rank = data.draw(st.integers(len(dims), 4))
    placed = sorted(data.draw(st.lists(st.integers(0, rank - 1), min_size=len(dims), max_size=len(dims),
                                       unique=True)))
    out_dims = [data.draw(st.integers(1, 4)) for _ in range(rank)]
    for d, size in zip(placed, dims):
        out_dims[d] = size
    x = _array(dims, dtype)

    (out,) = run_fn(lambda scribe: so.broadcast(_param(scribe, dtype, dims), out_dims, placed), x)
    view = [size if i in placed else 1 for i, size in enumerate(out_dims)]
    np.testing.assert_array_equal(out, np.broadcast_to(x.reshape(view), out_dims))


@SETTINGS
@given(dims=shapes, dtype=dtypes, data=st.data())
def test_slice_along(dims, dtype, data):
    dim = data.draw(st.integers(0, len(dims) - 1))
    start = data.draw(st.integers(0, dims[dim] - 1))
    limit = data.draw(st.integers(start + 1, dims[dim]))
    stride = data.draw(st.integers(1, 3))
    x = _array(dims, dtype)

    (out,) = run_fn(lambda scribe: so.slice_along(_param(scribe, dtype, dims), dim, start, limit, stride), x)
    index = [slice(None)] * len(dims)
    index[dim] = slice(start, limit, stride)
    np.testing.assert_array_equal(out, x[tuple(index)])


def _clamped(starts, sizes, dims):
    return [min(max(s, 0), d - n) for s, n, d in zip(starts, sizes, dims)]


@SETTINGS
@given(dims=shapes, dtype=dtypes, data=st.data())
def test_dynamic_slice_clamps_starts_into_range(dims, dtype, data):
    sizes = [data.draw(st.integers(1, d)) for d in dims]
    starts = [data.draw(st.integers(-2, d + 2)) for d in dims]  # out of range on purpose
    x = _array(dims, dtype)

    def program(scribe):
        index = [scribe.s32.Parameter(parameter_number=i + 1) for i in range(len(dims))]
        return so.dynamic_slice(_param(scribe, dtype, dims), index, sizes)

    (out,) = run_fn(program, x, *[np.int32(s) for s in starts])
    begin = _clamped(starts, sizes, dims)
    np.testing.assert_array_equal(out, x[tuple(slice(b, b + n) for b, n in zip(begin, sizes))])


@SETTINGS
@given(dims=shapes, dtype=dtypes, data=st.data())
def test_dynamic_update_slice(dims, dtype, data):
    sizes = [data.draw(st.integers(1, d)) for d in dims]
    starts = [data.draw(st.integers(-2, d + 2)) for d in dims]
    x = _array(dims, dtype)
    update = _array(sizes, dtype, seed=1)

    def program(scribe):
        index = [scribe.s32.Parameter(parameter_number=i + 2) for i in range(len(dims))]
        return so.dynamic_update_slice(_param(scribe, dtype, dims), _param(scribe, dtype, sizes, 1), index)

    (out,) = run_fn(program, x, update, *[np.int32(s) for s in starts])
    expected = x.copy()
    begin = _clamped(starts, sizes, dims)
    expected[tuple(slice(b, b + n) for b, n in zip(begin, sizes))] = update
    np.testing.assert_array_equal(out, expected)


def test_static_start_indices():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)

    def program(scribe):
        a = _param(scribe, "f32", (3, 4))
        window = so.dynamic_slice(a, [1, 2], [2, 2])
        return [window, so.dynamic_update_slice(a, window, [0, 0])]

    window, updated = run_fn(program, x)
    np.testing.assert_array_equal(window, x[1:3, 2:4])
    expected = x.copy()
    expected[:2, :2] = x[1:3, 2:4]
    np.testing.assert_array_equal(updated, expected)


@SETTINGS
@given(dims=shapes, dtype=dtypes, data=st.data())
def test_concatenate(dims, dtype, data):
    dim = data.draw(st.integers(0, len(dims) - 1))
    parts = []
    for i in range(data.draw(st.integers(1, 3))):
        part_dims = list(dims)
        part_dims[dim] = data.draw(st.integers(1, 4))
        parts.append(_array(part_dims, dtype, seed=i))

    def program(scribe):
        return so.concatenate([_param(scribe, dtype, p.shape, i) for i, p in enumerate(parts)], dim)

    (out,) = run_fn(program, *parts)
    np.testing.assert_array_equal(out, np.concatenate(parts, axis=dim))


@SETTINGS
@given(dims=shapes, dtype=dtypes, data=st.data())
def test_pad_with_edges_and_interior(dims, dtype, data):
    low = [data.draw(st.integers(0, 2)) for _ in dims]
    high = [data.draw(st.integers(0, 2)) for _ in dims]
    interior = [data.draw(st.integers(0, 2)) for _ in dims]
    x = _array(dims, dtype)

    (out,) = run_fn(lambda scribe: so.pad(_param(scribe, dtype, dims), 7, low, high, interior), x)
    out_dims = [lo + hi + d + (d - 1) * it for d, lo, hi, it in zip(dims, low, high, interior)]
    expected = np.full(out_dims, 7, dtype=x.dtype)
    expected[tuple(slice(lo, lo + (d - 1) * (it + 1) + 1, it + 1)
                   for d, lo, it in zip(dims, low, interior))] = x
    np.testing.assert_array_equal(out, expected)


def test_pad_with_a_value_operand_and_no_interior():
    x = np.array([[1, 2], [3, 4]], np.int32)

    def program(scribe):
        return so.pad(_param(scribe, "s32", (2, 2)), constant(scribe, "s32", -1), [1, 0], [0, 2])

    (out,) = run_fn(program, x)
    np.testing.assert_array_equal(out, np.pad(x, [(1, 0), (0, 2)], constant_values=-1))


@SETTINGS
@given(dims=shapes, dtype=st.sampled_from(["s32", "f32", "u32"]), data=st.data())
def test_iota(dims, dtype, data):
    dim = data.draw(st.integers(0, len(dims) - 1))
    (out,) = run_fn(lambda scribe: so.iota(scribe, dtype, dims, dim))
    view = [d if i == dim else 1 for i, d in enumerate(dims)]
    expected = np.broadcast_to(np.arange(dims[dim]).reshape(view), dims).astype(numpy_dtype(dtype))
    np.testing.assert_array_equal(out, expected)


def test_make_tuple_and_get_tuple_element():
    def program(scribe):
        a = _param(scribe, "f32", (2,), 0)
        b = _param(scribe, "s32", (3,), 1)
        pair = so.make_tuple(a, b)
        return [so.get_tuple_element(pair, 1), so.get_tuple_element(pair, 0)]

    b, a = run_fn(program, np.array([1.5, 2.5], np.float32), np.array([1, 2, 3], np.int32))
    assert b.tolist() == [1, 2, 3] and a.tolist() == [1.5, 2.5]


def test_no_op_reshape_and_transpose_add_nothing():
    from pyhlo import compile_py_func

    def program(scribe):
        a = _param(scribe, "f32", (2, 3))
        assert so.reshape(a, (2, 3)) is a
        assert so.transpose(a, [0, 1]) is a
        assert so.concatenate([a], 0) is a
        return a

    compile_py_func(program)
