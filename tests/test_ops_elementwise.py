"""Elementwise ops against numpy, over random shapes, in f32 and bf16."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hlo_run import run_fn
from hypothesis import given, settings
from hypothesis import strategies as st

from pyhlo.dtypes import numpy_dtype
from pyhlo.ops import elementwise as ew

BF16 = numpy_dtype("bf16")
SETTINGS = settings(max_examples=15, deadline=None)
shapes = st.lists(st.integers(1, 6), min_size=1, max_size=4).map(tuple)
seeds = st.integers(0, 2**32 - 1)

_erf = np.vectorize(math.erf, otypes=[np.float64])

BINARY = {
    "add": (ew.add, np.add),
    "subtract": (ew.subtract, np.subtract),
    "multiply": (ew.multiply, np.multiply),
    "divide": (ew.divide, np.divide),
    "maximum": (ew.maximum, np.maximum),
    "minimum": (ew.minimum, np.minimum),
    "power": (ew.power, np.power),
}

# name -> (op, numpy reference, whether it needs a positive input)
UNARY = {
    "exp": (ew.exp, np.exp, False),
    "log": (ew.log, np.log, True),
    "sqrt": (ew.sqrt, np.sqrt, True),
    "rsqrt": (ew.rsqrt, lambda x: 1 / np.sqrt(x), True),
    "tanh": (ew.tanh, np.tanh, False),
    "logistic": (ew.logistic, lambda x: 1 / (1 + np.exp(-x)), False),
    "negate": (ew.negate, np.negative, False),
    "abs": (ew.abs, np.abs, False),
    "erf": (ew.erf, _erf, False),
    "sin": (ew.sin, np.sin, False),
    "cos": (ew.cos, np.cos, False),
    "floor": (ew.floor, np.floor, False),
}


def _param(scribe, dtype, dims, n):
    return getattr(scribe, dtype)[dims].Parameter(parameter_number=n)


def _inputs(seed, dims, dtype, positive=False):
    rng = np.random.default_rng(seed)
    x = rng.uniform(0.1, 4.0, dims) if positive else rng.uniform(-4.0, 4.0, dims)
    return x.astype(numpy_dtype(dtype))


@pytest.mark.quick
@SETTINGS
@given(dims=shapes, seed=seeds)
def test_binary_ops_f32(dims, seed):
    a = _inputs(seed, dims, "f32")
    b = _inputs(seed + 1, dims, "f32", positive=True)  # positive: a valid divisor and power base

    def program(scribe):
        x, y = _param(scribe, "f32", dims, 0), _param(scribe, "f32", dims, 1)
        return [op(y if name == "power" else x, y) for name, (op, _) in BINARY.items()]

    for (name, (_, ref)), out in zip(BINARY.items(), run_fn(program, a, b)):
        expected = ref(b, b) if name == "power" else ref(a, b)
        np.testing.assert_allclose(out, expected, rtol=2e-6, atol=1e-6, err_msg=name)


@SETTINGS
@given(dims=shapes, seed=seeds)
def test_binary_ops_bf16(dims, seed):
    a = _inputs(seed, dims, "bf16")
    b = _inputs(seed + 1, dims, "bf16", positive=True)

    def program(scribe):
        x, y = _param(scribe, "bf16", dims, 0), _param(scribe, "bf16", dims, 1)
        return [op(x, y) for name, (op, _) in BINARY.items() if name != "power"]

    outs = run_fn(program, a, b)
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    for (name, (_, ref)), out in zip([i for i in BINARY.items() if i[0] != "power"], outs):
        assert out.dtype == BF16
        # The exact result rounded to bf16 (possibly via f32): within one bf16 ulp, 2^-7 relative.
        np.testing.assert_allclose(out.astype(np.float32), ref(a32, b32), rtol=2**-7, atol=1e-6, err_msg=name)


@SETTINGS
@given(dims=shapes, seed=seeds)
def test_unary_ops_f32(dims, seed):
    x = _inputs(seed, dims, "f32")
    positive = _inputs(seed, dims, "f32", positive=True)

    def program(scribe):
        a, p = _param(scribe, "f32", dims, 0), _param(scribe, "f32", dims, 1)
        return [op(p if pos else a) for op, _, pos in UNARY.values()]

    for (name, (_, ref, pos)), out in zip(UNARY.items(), run_fn(program, x, positive)):
        expected = ref((positive if pos else x).astype(np.float64))
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=2e-6, err_msg=name)


@SETTINGS
@given(dims=shapes, seed=seeds)
def test_unary_ops_bf16(dims, seed):
    x = _inputs(seed, dims, "bf16")
    positive = _inputs(seed, dims, "bf16", positive=True)

    def program(scribe):
        a, p = _param(scribe, "bf16", dims, 0), _param(scribe, "bf16", dims, 1)
        return [op(p if pos else a) for op, _, pos in UNARY.values()]

    for (name, (_, ref, pos)), out in zip(UNARY.items(), run_fn(program, x, positive)):
        expected = ref((positive if pos else x).astype(np.float64))
        np.testing.assert_allclose(out.astype(np.float64), expected, rtol=1e-2, atol=1e-2, err_msg=name)


def test_python_scalars_and_scalar_values_broadcast():
    x = np.array([[1.0, -2.0, 3.0], [0.5, 4.0, -6.0]], np.float32)

    def program(scribe):
        a = _param(scribe, "f32", (2, 3), 0)
        two = ew.constant(scribe, "f32", 2.0)
        return [ew.add(a, 1), ew.subtract(10, a), ew.multiply(two, a), ew.divide(a, two), ew.full_like(a, 7)]

    plus_one, ten_minus, doubled, halved, sevens = run_fn(program, x)
    np.testing.assert_array_equal(plus_one, x + 1)
    np.testing.assert_array_equal(ten_minus, 10 - x)
    np.testing.assert_array_equal(doubled, 2 * x)
    np.testing.assert_array_equal(halved, x / 2)
    np.testing.assert_array_equal(sevens, np.full((2, 3), 7, np.float32))


def test_mismatched_shapes_must_be_broadcast_explicitly():
    from pyhlo import compile_py_func

    def program(scribe):
        return ew.add(_param(scribe, "f32", (2, 3), 0), _param(scribe, "f32", (3,), 1))

    with pytest.raises(ValueError, match=r"f32\[2,3\] and f32\[3\]: broadcast one explicitly"):
        compile_py_func(program)


DIRECTIONS = {"EQ": np.equal, "NE": np.not_equal, "LT": np.less, "LE": np.less_equal,
              "GT": np.greater, "GE": np.greater_equal}


@SETTINGS
@given(dims=shapes, seed=seeds, dtype=st.sampled_from(["f32", "s32", "u32", "bf16"]))
def test_compare_and_select(dims, seed, dtype):
    rng = np.random.default_rng(seed)
    # Few distinct values, so EQ and the boundaries of LE/GE are exercised.
    a = rng.integers(0, 4, dims).astype(numpy_dtype(dtype))
    b = rng.integers(0, 4, dims).astype(numpy_dtype(dtype))

    def program(scribe):
        x, y = _param(scribe, dtype, dims, 0), _param(scribe, dtype, dims, 1)
        masks = [ew.compare(x, y, d) for d in DIRECTIONS]
        one = ew.constant(scribe, "s32", 1)
        return masks + [ew.select(masks[2], x, y), ew.select(masks[2], one, 0)]

    *masks, smaller, ones = run_fn(program, a, b)
    for (direction, ref), mask in zip(DIRECTIONS.items(), masks):
        assert mask.dtype == np.bool_
        np.testing.assert_array_equal(mask, ref(a, b), err_msg=direction)
    np.testing.assert_array_equal(smaller, np.where(a < b, a, b))
    np.testing.assert_array_equal(ones, (a < b).astype(np.int32))


def test_two_python_numbers_need_a_type():
    from pyhlo import compile_py_func

    def program(scribe):
        return ew.select(_param(scribe, "pred", (3,), 0), 1, 0)

    with pytest.raises(TypeError, match="at least one operand must be an HloValue"):
        compile_py_func(program)


@SETTINGS
@given(dims=shapes, seed=seeds)
def test_convert_rounds_and_truncates_like_numpy(dims, seed):
    x = _inputs(seed, dims, "f32") * 10

    def program(scribe):
        a = _param(scribe, "f32", dims, 0)
        return [ew.convert(a, "bf16"), ew.convert(a, "s32"), ew.convert(a, "f16"), ew.convert(a, "f32")]

    bf16, s32, f16, same = run_fn(program, x)
    np.testing.assert_array_equal(bf16, x.astype(BF16))  # round to nearest even
    np.testing.assert_array_equal(s32, np.trunc(x).astype(np.int32))  # toward zero
    np.testing.assert_array_equal(f16, x.astype(np.float16))
    np.testing.assert_array_equal(same, x)


def test_convert_to_the_same_type_adds_nothing():
    from pyhlo import compile_py_func

    def program(scribe):
        a = _param(scribe, "f32", (3,), 0)
        assert ew.convert(a, "f32") is a
        return a

    compile_py_func(program)


@SETTINGS
@given(dims=shapes, seed=seeds)
def test_bitcast_convert_reinterprets_bits(dims, seed):
    x = _inputs(seed, dims, "f32")

    def program(scribe):
        a = _param(scribe, "f32", dims, 0)
        bits = ew.bitcast_convert(a, "u32")
        return [bits, ew.bitcast_convert(bits, "f32")]

    bits, back = run_fn(program, x)
    np.testing.assert_array_equal(bits, x.view(np.uint32))
    np.testing.assert_array_equal(back, x)


@SETTINGS
@given(dims=shapes, seed=seeds)
def test_bitcast_convert_changes_width_in_memory_order(dims, seed):
    x = _inputs(seed, dims, "f32")

    def program(scribe):
        a = _param(scribe, "f32", dims, 0)
        narrow = ew.bitcast_convert(a, "s8")
        halves = ew.bitcast_convert(a, "u16")
        return [narrow, halves, ew.bitcast_convert(narrow, "f32"), ew.bitcast_convert(halves, "f32")]

    narrow, halves, back, back_from_halves = run_fn(program, x)
    np.testing.assert_array_equal(narrow, x.view(np.int8).reshape(*dims, 4))
    np.testing.assert_array_equal(halves, x.view(np.uint16).reshape(*dims, 2))
    np.testing.assert_array_equal(back, x)
    np.testing.assert_array_equal(back_from_halves, x)


def test_bitcast_convert_to_a_wider_type_needs_the_matching_last_dimension():
    from pyhlo import compile_py_func
    from pyhlo.shape_inference import HloShapeError

    def program(scribe):
        return ew.bitcast_convert(_param(scribe, "s8", (3, 2), 0), "f32")

    with pytest.raises(HloShapeError, match="last dimension must be that many"):
        compile_py_func(program)


def test_constants_and_broadcast_scalar():
    def program(scribe):
        vector = ew.constant(scribe, "s32", [3, 1, 4], (3,))
        filled = ew.constant(scribe, "f32", 2.5, (2, 2))
        spread = ew.broadcast_scalar(ew.constant(scribe, "bf16", 0.5), (2, 3))
        return [vector, filled, spread]

    vector, filled, spread = run_fn(program)
    assert vector.tolist() == [3, 1, 4]
    assert filled.tolist() == [[2.5, 2.5], [2.5, 2.5]]
    assert spread.dtype == BF16 and spread.astype(np.float32).tolist() == [[0.5] * 3] * 2
