"""The scribe: writing HLO modules in Python, running them, and the errors a bad build gives."""
from __future__ import annotations

import numpy as np
import pytest
from hlo_run import run_fn, run_module

from pyhlo import HloShapeError, compile_py_func
from pyhlo.dtypes import ELEMENT_TYPES, numpy_dtype
from pyhlo.schema import hlo_pb2

BF16 = numpy_dtype("bf16")


@pytest.mark.quick
def test_lm_head_from_transformers_neuronx():
    hidden_size, n_active_tokens, batch_size, vocab_size = 16, 3, 2, 40

    def lm_head(scribe):
        dtype = scribe.f32
        hidden = dtype[hidden_size, n_active_tokens, batch_size].Parameter(parameter_number=0)
        weight = dtype[hidden_size, vocab_size].Parameter(parameter_number=1)
        rhs_size = n_active_tokens * batch_size
        hidden = dtype[hidden_size, rhs_size].Reshape(hidden)
        dot_dims = dict(lhs_contracting_dimensions=[0], rhs_contracting_dimensions=[0])
        logits = dtype[vocab_size, rhs_size].Dot(weight, hidden, dot_dimension_numbers=dot_dims)
        return dtype[vocab_size, n_active_tokens, batch_size].Reshape(logits)

    proto = compile_py_func(lm_head)

    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((hidden_size, n_active_tokens, batch_size), dtype=np.float32)
    weight = rng.standard_normal((hidden_size, vocab_size), dtype=np.float32)
    (logits,) = run_module(proto, hidden, weight)
    expected = (weight.T @ hidden.reshape(hidden_size, -1)).reshape(vocab_size, n_active_tokens, batch_size)
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)


def add_f32(scribe):
    a = scribe.f32.Parameter(parameter_number=0)
    b = scribe.f32.Parameter(parameter_number=1)
    return scribe.f32.Add(a, b)


def max_f32(scribe):
    a = scribe.f32.Parameter(parameter_number=0)
    b = scribe.f32.Parameter(parameter_number=1)
    return scribe.f32.Maximum(a, b)


def test_two_layer_mlp_with_softmax():
    batch, n_in, n_hidden, n_out = 4, 8, 16, 5

    def mlp(scribe):
        f32 = scribe.f32
        x = f32[batch, n_in].Parameter(parameter_number=0)
        w1 = f32[n_in, n_hidden].Parameter(parameter_number=1)
        b1 = f32[n_hidden].Parameter(parameter_number=2)
        w2 = f32[n_hidden, n_out].Parameter(parameter_number=3)
        matmul = dict(lhs_contracting_dimensions=[1], rhs_contracting_dimensions=[0])
        h = f32[batch, n_hidden].Dot(x, w1, dot_dimension_numbers=matmul)
        h = f32[batch, n_hidden].Add(h, f32[batch, n_hidden].Broadcast(b1, dimensions=[1]))
        zero = f32[batch, n_hidden].Broadcast(f32.Constant(constant_value=0.0), dimensions=[])
        h = f32[batch, n_hidden].Maximum(h, zero)
        logits = f32[batch, n_out].Dot(h, w2, dot_dimension_numbers=matmul)
        lowest = f32.Constant(constant_value=-np.inf)
        row_max = f32[batch].Reduce(logits, lowest, dimensions=[1], to_apply=max_f32)
        shifted = f32[batch, n_out].Subtract(logits, f32[batch, n_out].Broadcast(row_max, dimensions=[0]))
        e = f32[batch, n_out].Exp(shifted)
        total = f32[batch].Reduce(e, f32.Constant(constant_value=0.0), dimensions=[1], to_apply=add_f32)
        return f32[batch, n_out].Divide(e, f32[batch, n_out].Broadcast(total, dimensions=[0]))

    rng = np.random.default_rng(1)
    x = rng.standard_normal((batch, n_in), dtype=np.float32)
    w1 = rng.standard_normal((n_in, n_hidden), dtype=np.float32)
    b1 = rng.standard_normal(n_hidden, dtype=np.float32)
    w2 = rng.standard_normal((n_hidden, n_out), dtype=np.float32)
    (probs,) = run_fn(mlp, x, w1, b1, w2)

    logits = np.maximum(x @ w1 + b1, 0) @ w2
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    np.testing.assert_allclose(probs, e / e.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-6)


def _shapes(shape: hlo_pb2.ShapeProto):
    yield shape
    for element in shape.tuple_shapes:
        yield from _shapes(element)


def _reduce_program(scribe):
    x = scribe.f32[3, 4].Parameter(parameter_number=0, name="x")
    scale = scribe.f32.Parameter(parameter_number=1, name="scale")
    zero = scribe.f32.Constant(constant_value=0.0)
    rows = scribe.f32[3].Reduce(x, zero, dimensions=[1], to_apply=add_f32)
    cols = scribe.f32[4].Reduce(x, zero, dimensions=[0], to_apply=add_f32)
    total = scribe.f32.Reduce(rows, zero, dimensions=[0], to_apply=add_f32)
    return [rows, cols, scribe.f32.Multiply(total, scale)]


def test_module_structure():
    module = compile_py_func(_reduce_program)

    assert module.name == "_reduce_program"
    entry = module.computations[-1]
    assert module.entry_computation_id == entry.id
    assert module.entry_computation_name == entry.name

    # Names and ids are unique across the module.
    names = [i.name for c in module.computations for i in c.instructions]
    ids = [i.id for c in module.computations for i in c.instructions]
    assert len(set(names)) == len(names)
    assert len(set(ids)) == len(ids)
    assert len({c.name for c in module.computations}) == len(module.computations)
    assert len({c.id for c in module.computations}) == len(module.computations)

    # A called computation is listed before every computation that calls it; operands come first too.
    seen_computations: set[int] = set()
    for computation in module.computations:
        seen = set()
        for instruction in computation.instructions:
            assert set(instruction.called_computation_ids) <= seen_computations
            assert set(instruction.operand_ids) <= seen
            seen.add(instruction.id)
        assert computation.root_id in seen
        seen_computations.add(computation.id)

    # The program shape names every parameter.
    assert list(module.host_program_shape.parameter_names) == ["x", "scale"]
    assert [list(p.dimensions) for p in module.host_program_shape.parameters] == [[3, 4], []]
    assert len(module.host_program_shape.result.tuple_shapes) == 3

    # Every array shape, including literals', carries a row-major layout.
    for computation in module.computations:
        for instruction in computation.instructions:
            shapes = list(_shapes(instruction.shape))
            if instruction.HasField("literal"):
                shapes += list(_shapes(instruction.literal.shape))
            for shape in shapes:
                if shape.element_type != hlo_pb2.TUPLE:
                    rank = len(shape.dimensions)
                    assert list(shape.layout.minor_to_major) == list(reversed(range(rank)))

    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    rows, cols, total = run_module(module, x, np.float32(0.5))
    np.testing.assert_allclose(rows, x.sum(1))
    np.testing.assert_allclose(cols, x.sum(0))
    np.testing.assert_allclose(total, x.sum() * 0.5)


def test_sub_computations_are_reused():
    module = compile_py_func(_reduce_program)
    reduces = [i for i in module.computations[-1].instructions if i.opcode == "reduce"]
    assert len(reduces) == 3
    assert len({tuple(r.called_computation_ids) for r in reduces}) == 1
    assert len(module.computations) == 2


CONSTANTS = {
    "pred": np.array([True, False, True]),
    "s8": np.array([-128, 0, 127], np.int8),
    "u8": np.array([0, 7, 255], np.uint8),
    "s16": np.array([-32768, 1, 32767], np.int16),
    "u16": np.array([0, 2, 65535], np.uint16),
    "s32": np.array([-(2**31), 3, 2**31 - 1], np.int32),
    "u32": np.array([0, 4, 2**32 - 1], np.uint32),
    "s64": np.array([-(2**40), 5, 2**40], np.int64),
    "u64": np.array([0, 6, 2**40], np.uint64),
    "f16": np.array([-65504.0, 0.5, 1e-3], np.float16),
    "bf16": np.array([-3.0e38, 0.5, 1.0 / 3.0], BF16),
    "f32": np.array([-1.5, 0.1, 3.0e38], np.float32),
    "f64": np.array([-1.5, 0.1, 1e300], np.float64),
}


def test_constants_of_every_element_type():
    assert set(CONSTANTS) == set(ELEMENT_TYPES)

    def constants(scribe):
        return [getattr(scribe, name)[3].Constant(constant_value=value) for name, value in CONSTANTS.items()]

    outputs = run_fn(constants)
    for (name, value), out in zip(CONSTANTS.items(), outputs):
        # 64-bit values may come back narrowed when jax runs without x64.
        assert np.asarray(out).astype(value.dtype).tolist() == value.tolist() or name in ("s64", "u64"), name


def test_bf16_array_constant_and_scalar_fill():
    values = np.array([[1.0, -2.5], [0.1, 1e-3]], dtype=np.float32)

    def program(scribe):
        array = scribe.bf16[2, 2].Constant(constant_value=values)
        filled = scribe.bf16[2, 2].Constant(constant_value=0.25)
        return scribe.f32[2, 2].Convert(scribe.bf16[2, 2].Add(array, filled))

    (out,) = run_fn(program)
    expected = (values.astype(BF16).astype(np.float32) + 0.25).astype(BF16).astype(np.float32)
    np.testing.assert_array_equal(out, expected)


def test_tuple_and_get_tuple_element():
    def program(scribe):
        a = scribe.f32[2].Parameter(parameter_number=0)
        b = scribe.s32[3].Parameter(parameter_number=1)
        pair = scribe.tuple(a.shape, b.shape).Tuple(a, b)
        second = scribe.s32[3].GetTupleElement(pair, tuple_index=1)
        first = scribe.f32[2].GetTupleElement(pair, tuple_index=0)
        return [second, scribe.f32[2].Negate(first)]

    second, first = run_fn(program, np.array([1.0, 2.0], np.float32), np.array([4, 5, 6], np.int32))
    assert second.tolist() == [4, 5, 6]
    assert first.tolist() == [-1.0, -2.0]


def test_source_metadata_points_at_the_writer():
    module = compile_py_func(_reduce_program)
    reduce = next(i for i in module.computations[-1].instructions if i.opcode == "reduce")
    assert reduce.metadata.source_file == "test_scribe.py"
    assert reduce.metadata.op_name == "_reduce_program"
    assert reduce.metadata.source_line > 0


def test_source_metadata_of_library_ops_points_at_their_caller():
    from pyhlo.ops.nn import softmax

    def program(scribe):
        return softmax(scribe.f32[2, 3].Parameter(parameter_number=0))

    for instruction in compile_py_func(program).computations[-1].instructions:
        assert ((instruction.metadata.source_file, instruction.metadata.op_name)
                == ("test_scribe.py", "program"))


def test_source_metadata_can_be_left_out():
    module = compile_py_func(_reduce_program, record_source=False)
    assert not any(i.HasField("metadata") for c in module.computations for i in c.instructions)


def test_alias_makes_an_in_place_update():
    def update_cache(scribe):
        cache = scribe.f32[4, 3].Parameter(parameter_number=0, name="cache")
        row = scribe.f32[1, 3].Parameter(parameter_number=1, name="row")
        index = scribe.s32.Parameter(parameter_number=2, name="index")
        zero = scribe.s32.Constant(constant_value=0)
        updated = scribe.f32[4, 3].DynamicUpdateSlice(cache, row, index, zero)
        updated.set_alias_to(cache)
        return updated

    module = compile_py_func(update_cache)
    (entry,) = module.input_output_alias.entries
    assert entry.parameter_number == 0
    assert list(entry.output_shape_index) == []
    assert entry.kind == hlo_pb2.MAY_ALIAS

    cache = np.zeros((4, 3), np.float32)
    (out,) = run_module(module, cache, np.ones((1, 3), np.float32), np.int32(2))
    assert out.tolist() == [[0, 0, 0], [0, 0, 0], [1, 1, 1], [0, 0, 0]]


def test_alias_into_a_tuple_output():
    def step(scribe):
        cache = scribe.f32[4].Parameter(parameter_number=0)
        counter = scribe.s32.Parameter(parameter_number=1)
        one = scribe.s32.Constant(constant_value=1)
        new_counter = scribe.s32.Add(counter, one).set_alias_to(counter, must=True)
        return [scribe.f32[4].Negate(cache), new_counter]

    (entry,) = compile_py_func(step).input_output_alias.entries
    assert ((entry.parameter_number, list(entry.output_shape_index), entry.kind)
            == (1, [1], hlo_pb2.MUST_ALIAS))


# -- bad builds -----------------------------------------------------------------

def _build(fn):
    return compile_py_func(fn)


def test_wrong_operand_count():
    def program(scribe):
        a = scribe.f32[4].Parameter(parameter_number=0)
        return scribe.f32[4].Add(a)

    with pytest.raises(HloShapeError, match=r"add: takes 2 operand\(s\), got 1"):
        _build(program)


def test_mismatched_dot_contracting_sizes():
    def program(scribe):
        a = scribe.f32[4, 8].Parameter(parameter_number=0)
        b = scribe.f32[7, 3].Parameter(parameter_number=1)
        dims = dict(lhs_contracting_dimensions=[1], rhs_contracting_dimensions=[0])
        return scribe.f32[4, 3].Dot(a, b, dot_dimension_numbers=dims)

    with pytest.raises(HloShapeError, match=r"contracting lhs dim 1 \(size 8\) with rhs dim 0 \(size 7\)"):
        _build(program)


def test_mismatched_add_shapes():
    def program(scribe):
        a = scribe.f32[4].Parameter(parameter_number=0)
        b = scribe.f32[5].Parameter(parameter_number=1)
        return scribe.f32[4].Add(a, b)

    with pytest.raises(HloShapeError,
                       match=r"add: operands must have the same shape and type .*f32\[4\], f32\[5\]"):
        _build(program)


def test_wrong_declared_result_shape():
    def program(scribe):
        a = scribe.f32[4].Parameter(parameter_number=0)
        return scribe.f32[5].Negate(a)

    with pytest.raises(HloShapeError,
                       match=r"negate: result declared as f32\[5\] but operands \(f32\[4\]\) give f32\[4\]"):
        _build(program)


def test_gap_in_parameter_numbers():
    def program(scribe):
        scribe.f32[4].Parameter(parameter_number=0)
        return scribe.f32[4].Parameter(parameter_number=2)

    with pytest.raises(HloShapeError, match=r"parameter numbers \[0, 2\] must be 0..1 with no gaps"):
        _build(program)


def test_duplicate_parameter_number():
    def program(scribe):
        scribe.f32[4].Parameter(parameter_number=0)
        return scribe.f32[4].Parameter(parameter_number=0)

    with pytest.raises(HloShapeError, match="number 0 is used twice"):
        _build(program)


def test_alias_of_a_value_that_is_not_an_output():
    def program(scribe):
        a = scribe.f32[4].Parameter(parameter_number=0)
        scribe.f32[4].Negate(a).set_alias_to(a)
        return scribe.f32[4].Abs(a)

    with pytest.raises(HloShapeError, match="bad alias: negate is not an output"):
        _build(program)


def test_alias_with_a_shape_mismatch():
    def program(scribe):
        a = scribe.f32[4].Parameter(parameter_number=0)
        return scribe.s32[4].Convert(a).set_alias_to(a)

    with pytest.raises(HloShapeError,
                       match=r"bad alias: .* s32\[4\] and parameter .* f32\[4\] differ in shape"):
        _build(program)


def test_alias_to_something_that_is_not_a_parameter():
    def program(scribe):
        a = scribe.f32[4].Parameter(parameter_number=0)
        b = scribe.f32[4].Negate(a)
        return scribe.f32[4].Abs(b).set_alias_to(b)

    with pytest.raises(HloShapeError, match="bad alias: negate is not a parameter"):
        _build(program)


def test_parameter_aliased_twice():
    def program(scribe):
        a = scribe.f32[4].Parameter(parameter_number=0)
        x = scribe.f32[4].Negate(a).set_alias_to(a)
        y = scribe.f32[4].Abs(a).set_alias_to(a)
        return [x, y]

    with pytest.raises(HloShapeError, match="bad alias: parameter p0 is aliased twice"):
        _build(program)


def test_unknown_op_name():
    def program(scribe):
        a = scribe.f32[4].Parameter(parameter_number=0)
        return scribe.f32[4].Frobnicate(a)

    with pytest.raises(AttributeError, match="unknown HLO op 'Frobnicate'"):
        _build(program)


def test_unknown_attribute():
    def program(scribe):
        a = scribe.f32[4].Parameter(parameter_number=0)
        return scribe.f32[4].Negate(a, colour="blue")

    with pytest.raises(TypeError, match="negate: unknown attribute 'colour'"):
        _build(program)


def test_operand_that_is_not_a_value():
    def program(scribe):
        a = scribe.f32[4].Parameter(parameter_number=0)
        return scribe.f32[4].Add(a, 1.0)

    with pytest.raises(TypeError, match="add: operand 1 is a float, not an HloValue"):
        _build(program)


def test_result_that_is_not_a_value():
    with pytest.raises(TypeError, match="must return an HloValue, got int"):
        _build(lambda scribe: 3)


def _dot_module(dtype: str, f32_dot_precision: str = "highest", **attributes) -> str:
    def program(scribe):
        a = getattr(scribe, dtype)[2, 3].Parameter(parameter_number=0)
        b = getattr(scribe, dtype)[3, 4].Parameter(parameter_number=1)
        numbers = dict(lhs_contracting_dimensions=[1], rhs_contracting_dimensions=[0])
        return getattr(scribe, dtype)[2, 4].Dot(a, b, dot_dimension_numbers=numbers, **attributes)

    proto = compile_py_func(program, f32_dot_precision=f32_dot_precision)
    (dot,) = [i for c in proto.computations for i in c.instructions if i.opcode == "dot"]
    return list(dot.precision_config.operand_precision)


def test_a_raw_f32_dot_takes_the_modules_precision_unless_it_names_its_own():
    """transformers-neuronx style `f32[...].Dot(...)` is exact in f32 on a GPU too (not TF32)."""
    highest, default = hlo_pb2.PrecisionConfig.HIGHEST, hlo_pb2.PrecisionConfig.DEFAULT
    assert _dot_module("f32") == [highest, highest]
    assert _dot_module("f32", f32_dot_precision="high") == [hlo_pb2.PrecisionConfig.HIGH] * 2
    assert _dot_module("f32", f32_dot_precision="default") == []
    assert _dot_module("f32", precision_config={"operand_precision": ["DEFAULT", "DEFAULT"]}) == [default] * 2
    assert _dot_module("bf16") == []
