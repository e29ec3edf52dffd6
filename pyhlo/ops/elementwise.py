"""Elementwise math, comparison, selection and type conversion.

Binary ops take two values of the same shape, or a value and a scalar (an
HloValue scalar or a Python number), which is broadcast to the other's shape.
"""
from __future__ import annotations

from typing import Union

from pyhlo.dtypes import byte_size
from pyhlo.scribe import HloValue, Scribe

Operand = Union[HloValue, int, float]


def constant(scribe: Scribe, dtype: str, value, dims: tuple[int, ...] = ()) -> HloValue:
    """A constant of `dtype[dims]`; a scalar value fills every element."""
    return getattr(scribe, dtype)[dims].Constant(constant_value=value)


def full_like(x: HloValue, value) -> HloValue:
    """`value` broadcast to x's shape and type (a scalar constant, broadcast in the graph)."""
    scalar = constant(x.scribe, x.dtype, value)
    return broadcast_scalar(scalar, x.dims)


def broadcast_scalar(scalar: HloValue, dims: tuple[int, ...]) -> HloValue:
    if tuple(dims) == ():
        return scalar
    return getattr(scalar.scribe, scalar.dtype)[dims].Broadcast(scalar, dimensions=[])


def _pair(a: Operand, b: Operand) -> tuple[HloValue, HloValue]:
    if not isinstance(a, HloValue) and not isinstance(b, HloValue):
        raise TypeError(f"elementwise op on {a!r} and {b!r}: at least one operand must be an HloValue "
                        "(make the other a constant of the wanted type)")
    if not isinstance(a, HloValue):
        a, b = _pair(b, a)[::-1]
        return a, b
    if not isinstance(b, HloValue):
        b = constant(a.scribe, a.dtype, b)
    if a.dims != b.dims:
        if b.dims == ():
            b = broadcast_scalar(b, a.dims)
        elif a.dims == ():
            a = broadcast_scalar(a, b.dims)
        else:
            raise ValueError(f"elementwise op on {a.shape!r} and {b.shape!r}: broadcast one explicitly")
    return a, b


def _binary(op: str, a: Operand, b: Operand) -> HloValue:
    a, b = _pair(a, b)
    return getattr(a.shape, op)(a, b)


def add(a: Operand, b: Operand) -> HloValue:
    return _binary("Add", a, b)


def subtract(a: Operand, b: Operand) -> HloValue:
    return _binary("Subtract", a, b)


def multiply(a: Operand, b: Operand) -> HloValue:
    return _binary("Multiply", a, b)


def divide(a: Operand, b: Operand) -> HloValue:
    return _binary("Divide", a, b)


def maximum(a: Operand, b: Operand) -> HloValue:
    return _binary("Maximum", a, b)


def minimum(a: Operand, b: Operand) -> HloValue:
    return _binary("Minimum", a, b)


def power(a: Operand, b: Operand) -> HloValue:
    return _binary("Power", a, b)


def bitwise_and(a: Operand, b: Operand) -> HloValue:
    """a & b, integers (or preds)."""
    return _binary("And", a, b)


def bitwise_or(a: Operand, b: Operand) -> HloValue:
    """a | b, integers (or preds)."""
    return _binary("Or", a, b)


def shift_left(a: Operand, b: Operand) -> HloValue:
    """a << b, integers (b at least the bit width gives 0)."""
    return _binary("ShiftLeft", a, b)


def shift_right_logical(a: Operand, b: Operand) -> HloValue:
    """a >> b filling with zeros, integers (b at least the bit width gives 0)."""
    return _binary("ShiftRightLogical", a, b)


def _unary(op: str, x: HloValue) -> HloValue:
    return getattr(x.shape, op)(x)


def exp(x: HloValue) -> HloValue:
    return _unary("Exp", x)


def log(x: HloValue) -> HloValue:
    return _unary("Log", x)


def sqrt(x: HloValue) -> HloValue:
    return _unary("Sqrt", x)


def rsqrt(x: HloValue) -> HloValue:
    return _unary("Rsqrt", x)


def tanh(x: HloValue) -> HloValue:
    return _unary("Tanh", x)


def logistic(x: HloValue) -> HloValue:
    return _unary("Logistic", x)


def negate(x: HloValue) -> HloValue:
    return _unary("Negate", x)


def abs(x: HloValue) -> HloValue:  # noqa: A001 - named after the HLO op
    return _unary("Abs", x)


def erf(x: HloValue) -> HloValue:
    return _unary("Erf", x)


def sin(x: HloValue) -> HloValue:
    return _unary("Sin", x)


def cos(x: HloValue) -> HloValue:
    return _unary("Cos", x)


def floor(x: HloValue) -> HloValue:
    return _unary("Floor", x)


def compare(a: Operand, b: Operand, direction: str) -> HloValue:
    """a `direction` b elementwise, direction one of EQ NE LT LE GT GE; result pred."""
    a, b = _pair(a, b)
    return a.scribe.pred[a.dims].Compare(a, b, comparison_direction=direction)


def select(pred: HloValue, on_true: Operand, on_false: Operand) -> HloValue:
    on_true, on_false = _pair(on_true, on_false)
    if pred.dims != on_true.dims:
        if on_true.dims == ():
            on_true = broadcast_scalar(on_true, pred.dims)
            on_false = broadcast_scalar(on_false, pred.dims)
    return on_true.shape.Select(pred, on_true, on_false)


def convert(x: HloValue, dtype: str) -> HloValue:
    """x as `dtype` (a no-op when it already is)."""
    if x.dtype == dtype:
        return x
    return getattr(x.scribe, dtype)[x.dims].Convert(x)


def bitcast_convert(x: HloValue, dtype: str) -> HloValue:
    """Reinterpret the bits of x as `dtype`, in memory order (numpy's `view`). A narrower
    type adds a last dimension (f32[n] -> s8[n, 4]); a wider one consumes it (s8[n, 4] -> f32[n])."""
    wide, narrow = byte_size(x.dtype), byte_size(dtype)
    dims = x.dims + (wide // narrow,) if narrow < wide else x.dims[:-1] if narrow > wide else x.dims
    return getattr(x.scribe, dtype)[dims].BitcastConvert(x)
