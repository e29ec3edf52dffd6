"""Build-time shape rules: what each HLO op's result must be, given its operands.

`expected_shape` returns the shape an op must have (dims, and the element type
when the op fixes it) so that a mistake fails when the program is written,
naming the op and its operands, rather than later inside XLA.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from pyhlo.opcodes import BINARY_SAME, UNARY_SAME, UNCHECKED
from pyhlo.shapes import ArrayShape, Shape, TupleShape


class HloShapeError(ValueError):
    """A program is ill-formed: wrong operand count, mismatched shapes, bad attributes."""


OPERAND_COUNTS: dict[str, int] = {
    **{op: 1 for op in UNARY_SAME},
    **{op: 2 for op in BINARY_SAME},
    "parameter": 0, "constant": 0, "iota": 0, "replica-id": 0, "partition-id": 0,
    "compare": 2, "select": 3, "clamp": 3, "convert": 1, "bitcast-convert": 1, "is-finite": 1,
    "broadcast": 1, "reshape": 1, "transpose": 1, "slice": 1, "concatenate": -1, "pad": 2,
    "dot": 2, "get-tuple-element": 1, "topk": 1,
}


def _describe(operands: Sequence[Any]) -> str:
    return ", ".join(repr(o.shape) for o in operands) or "none"


def _fail(opcode: str, operands: Sequence[Any], problem: str) -> HloShapeError:
    return HloShapeError(f"{opcode}: {problem} (operands: {_describe(operands)})")


def _arrays(opcode: str, operands: Sequence[Any]) -> list[ArrayShape]:
    shapes = [o.shape for o in operands]
    for s in shapes:
        if not isinstance(s, ArrayShape):
            raise _fail(opcode, operands, f"expects array operands, got tuple {s!r}")
    return shapes  # type: ignore[return-value]


def expected_shape(
    opcode: str, result: Shape, operands: Sequence[Any], attrs: dict[str, Any]
) -> tuple[str | None, tuple[int, ...]] | TupleShape | None:
    """(dtype or None if free, dims) the result must have; None when unchecked."""
    want = OPERAND_COUNTS.get(opcode)
    if want is not None and want >= 0 and len(operands) != want:
        raise _fail(opcode, operands, f"takes {want} operand(s), got {len(operands)}")
    if opcode in UNCHECKED or opcode in ("parameter",):
        return None
    if opcode == "tuple":
        return TupleShape(result.scribe, tuple(o.shape for o in operands))
    if opcode == "get-tuple-element":
        shape = operands[0].shape
        index = attrs.get("tuple_index", 0)
        if not isinstance(shape, TupleShape) or not 0 <= index < len(shape.elements):
            raise _fail(opcode, operands, f"tuple_index {index} is not an element of a tuple")
        element = shape.elements[index]
        return element if isinstance(element, TupleShape) else (element.dtype, element.dims)
    if opcode == "sort":
        if len(operands) == 1:
            return (operands[0].shape.dtype, operands[0].shape.dims)
        return TupleShape(result.scribe, tuple(o.shape for o in operands))
    if opcode == "while":
        return None
    shapes = _arrays(opcode, operands)
    if opcode in UNARY_SAME:
        return (shapes[0].dtype, shapes[0].dims)
    if opcode in BINARY_SAME:
        a, b = shapes
        if a.dims != b.dims or a.dtype != b.dtype:
            raise _fail(opcode, operands, "operands must have the same shape and type")
        return (a.dtype, a.dims)
    if opcode == "compare":
        a, b = shapes
        if a.dims != b.dims or a.dtype != b.dtype:
            raise _fail(opcode, operands, "operands must have the same shape and type")
        return ("pred", a.dims)
    if opcode == "is-finite":
        return ("pred", shapes[0].dims)
    if opcode == "select":
        pred, on_true, on_false = shapes
        if pred.dtype != "pred" or pred.dims not in (on_true.dims, ()):
            raise _fail(opcode, operands, "first operand must be pred with the shape of the others")
        if on_true.dims != on_false.dims or on_true.dtype != on_false.dtype:
            raise _fail(opcode, operands, "on_true and on_false must have the same shape and type")
        return (on_true.dtype, on_true.dims)
    if opcode == "clamp":
        low, x, high = shapes
        for bound in (low, high):
            if bound.dims not in ((), x.dims) or bound.dtype != x.dtype:
                raise _fail(opcode, operands, "bounds must be scalars or match the operand")
        return (x.dtype, x.dims)
    if opcode == "convert":
        return (None, shapes[0].dims)
    if opcode == "bitcast-convert":
        # Same element width keeps the dims; a wider or narrower type adds or drops the last dim.
        from pyhlo.dtypes import byte_size

        wide, narrow = byte_size(shapes[0].dtype), byte_size(result.dtype)
        dims = shapes[0].dims
        if narrow < wide:
            return (None, dims + (wide // narrow,))
        if narrow > wide:
            if not dims or dims[-1] * wide != narrow:
                raise _fail(opcode, operands, f"a {result.dtype} is {narrow // wide} of {shapes[0].dtype}: "
                                              "the operand's last dimension must be that many")
            return (None, dims[:-1])
        return (None, dims)
    if opcode == "broadcast":
        return _broadcast(result, shapes[0], attrs, operands)
    if opcode == "reshape":
        if result.num_elements != shapes[0].num_elements:
            raise _fail(
                opcode, operands,
                f"cannot reshape {shapes[0].num_elements} elements into {result!r}",
            )
        return (shapes[0].dtype, result.dims)
    if opcode == "transpose":
        perm = list(attrs.get("dimensions", []))
        if sorted(perm) != list(range(shapes[0].rank)):
            raise _fail(opcode, operands, f"dimensions={perm} is not a permutation of the operand's")
        return (shapes[0].dtype, tuple(shapes[0].dims[p] for p in perm))
    if opcode == "slice":
        return _slice(shapes[0], attrs, operands)
    if opcode == "dynamic-slice":
        return _dynamic_slice(shapes, attrs, operands)
    if opcode == "dynamic-update-slice":
        return _dynamic_update_slice(shapes, operands)
    if opcode == "concatenate":
        return _concatenate(shapes, attrs, operands)
    if opcode == "pad":
        return _pad(shapes, attrs, operands)
    if opcode == "iota":
        dims = attrs.get("dimensions", [])
        if len(dims) != 1 or not 0 <= dims[0] < max(result.rank, 1):
            raise _fail(opcode, operands, "needs dimensions=[iota_dimension] within the result rank")
        return None
    if opcode == "dot":
        return _dot(shapes, attrs, operands)
    if opcode == "reduce":
        return _reduce(result, shapes, attrs, operands)
    if opcode == "reduce-window":
        return _reduce_window(shapes, attrs, operands)
    if opcode == "topk":
        k = attrs.get("k", 0)
        x = shapes[0]
        if not 0 < k <= x.dims[-1]:
            raise _fail(opcode, operands, f"k={k} must be in 1..{x.dims[-1]}")
        dims = x.dims[:-1] + (k,)
        return TupleShape(
            result.scribe, (ArrayShape(result.scribe, x.dtype, dims), ArrayShape(result.scribe, "s32", dims))
        )
    if opcode == "all-reduce":
        if len(shapes) == 1:
            return (shapes[0].dtype, shapes[0].dims)
        return TupleShape(result.scribe, tuple(o.shape for o in operands))
    if opcode in ("replica-id", "partition-id"):
        return ("u32", ())
    if opcode == "constant":
        return None
    return None


def _broadcast(result: ArrayShape, x: ArrayShape, attrs: dict, operands: Sequence[Any]):
    dims = list(attrs.get("dimensions", []))
    if len(dims) != x.rank:
        raise _fail("broadcast", operands, f"dimensions={dims} must list one output dim per operand dim")
    for i, d in enumerate(dims):
        if not 0 <= d < result.rank or result.dims[d] != x.dims[i]:
            raise _fail(
                "broadcast", operands,
                f"operand dim {i} (size {x.dims[i]}) maps to output dim {d} of {result!r}",
            )
    return (x.dtype, result.dims)


def _slice(x: ArrayShape, attrs: dict, operands: Sequence[Any]):
    slices = attrs.get("slice_dimensions", [])
    if len(slices) != x.rank:
        raise _fail("slice", operands, f"needs {x.rank} slice_dimensions, got {len(slices)}")
    dims = []
    for i, s in enumerate(slices):
        start, limit, stride = s.get("start", 0), s.get("limit", 0), s.get("stride", 1) or 1
        if not 0 <= start <= limit <= x.dims[i]:
            raise _fail("slice", operands, f"dim {i}: [{start}, {limit}) is outside 0..{x.dims[i]}")
        dims.append(math.ceil((limit - start) / stride))
    return (x.dtype, tuple(dims))


def _check_indices(opcode: str, indices: Sequence[ArrayShape], rank: int, operands) -> None:
    if len(indices) != rank:
        raise _fail(opcode, operands, f"needs {rank} scalar start indices, got {len(indices)}")
    for s in indices:
        if s.dims != () or s.dtype not in ("s32", "s64", "u32", "u64", "s16", "u16", "s8", "u8"):
            raise _fail(opcode, operands, "start indices must be integer scalars")


def _dynamic_slice(shapes: list[ArrayShape], attrs: dict, operands):
    x, indices = shapes[0], shapes[1:]
    _check_indices("dynamic-slice", indices, x.rank, operands)
    sizes = tuple(attrs.get("dynamic_slice_sizes", []))
    if len(sizes) != x.rank or any(not 0 <= s <= d for s, d in zip(sizes, x.dims)):
        raise _fail("dynamic-slice", operands, f"dynamic_slice_sizes={list(sizes)} must fit {x!r}")
    return (x.dtype, sizes)


def _dynamic_update_slice(shapes: list[ArrayShape], operands):
    if len(shapes) < 2:
        raise _fail("dynamic-update-slice", operands, "needs operand, update and start indices")
    x, update, indices = shapes[0], shapes[1], shapes[2:]
    _check_indices("dynamic-update-slice", indices, x.rank, operands)
    if update.rank != x.rank or any(u > d for u, d in zip(update.dims, x.dims)):
        raise _fail("dynamic-update-slice", operands, "update must have the operand's rank and fit in it")
    if update.dtype != x.dtype:
        raise _fail("dynamic-update-slice", operands, "update must have the operand's element type")
    return (x.dtype, x.dims)


def _concatenate(shapes: list[ArrayShape], attrs: dict, operands):
    dims = attrs.get("dimensions", [])
    if not shapes or len(dims) != 1:
        raise _fail("concatenate", operands, "needs operands and dimensions=[d]")
    d = dims[0]
    first = shapes[0]
    for s in shapes[1:]:
        if s.rank != first.rank or s.dtype != first.dtype or any(
            a != b for i, (a, b) in enumerate(zip(s.dims, first.dims)) if i != d
        ):
            raise _fail("concatenate", operands, f"operands must agree except in dimension {d}")
    out = list(first.dims)
    out[d] = sum(s.dims[d] for s in shapes)
    return (first.dtype, tuple(out))


def _pad(shapes: list[ArrayShape], attrs: dict, operands):
    x, value = shapes
    if value.dims != () or value.dtype != x.dtype:
        raise _fail("pad", operands, "padding value must be a scalar of the operand's type")
    config = attrs.get("padding_config", {}).get("dimensions", [])
    if len(config) != x.rank:
        raise _fail("pad", operands, f"padding_config needs {x.rank} dimensions")
    out = []
    for size, c in zip(x.dims, config):
        low, high, interior = (c.get("edge_padding_low", 0), c.get("edge_padding_high", 0),
                               c.get("interior_padding", 0))
        out.append(low + high + size + max(size - 1, 0) * interior)
    return (x.dtype, tuple(out))


def _dot(shapes: list[ArrayShape], attrs: dict, operands):
    lhs, rhs = shapes
    numbers = attrs.get("dot_dimension_numbers", {})
    lc = list(numbers.get("lhs_contracting_dimensions", []))
    rc = list(numbers.get("rhs_contracting_dimensions", []))
    lb = list(numbers.get("lhs_batch_dimensions", []))
    rb = list(numbers.get("rhs_batch_dimensions", []))
    if len(lc) != len(rc) or len(lb) != len(rb):
        raise _fail("dot", operands, "lhs and rhs need as many contracting and batch dimensions")
    for a, b in zip(lc, rc):
        if lhs.dims[a] != rhs.dims[b]:
            raise _fail(
                "dot", operands,
                f"contracting lhs dim {a} (size {lhs.dims[a]}) with rhs dim {b} (size {rhs.dims[b]})",
            )
    for a, b in zip(lb, rb):
        if lhs.dims[a] != rhs.dims[b]:
            raise _fail("dot", operands, f"batch lhs dim {a} and rhs dim {b} differ in size")
    lhs_free = [d for i, d in enumerate(lhs.dims) if i not in lc and i not in lb]
    rhs_free = [d for i, d in enumerate(rhs.dims) if i not in rc and i not in rb]
    return (None, tuple([lhs.dims[i] for i in lb] + lhs_free + rhs_free))


def _reduce(result: Shape, shapes: list[ArrayShape], attrs: dict, operands):
    if len(shapes) % 2:
        raise _fail("reduce", operands, "needs one init value per reduced operand")
    n = len(shapes) // 2
    inputs, inits = shapes[:n], shapes[n:]
    reduced = set(attrs.get("dimensions", []))
    for x, init in zip(inputs, inits):
        if init.dims != ():
            raise _fail("reduce", operands, "init values must be scalars")
        if x.dims != inputs[0].dims:
            raise _fail("reduce", operands, "reduced operands must have the same dims")
        if any(not 0 <= d < x.rank for d in reduced):
            raise _fail("reduce", operands, f"dimensions={sorted(reduced)} outside rank {x.rank}")
    dims = tuple(d for i, d in enumerate(inputs[0].dims) if i not in reduced)
    if n == 1:
        return (inits[0].dtype, dims)
    return TupleShape(
        result.scribe, tuple(ArrayShape(result.scribe, init.dtype, dims) for init in inits)
    )


def _reduce_window(shapes: list[ArrayShape], attrs: dict, operands):
    if len(shapes) != 2:
        return None
    x, init = shapes
    window = attrs.get("window", {}).get("dimensions", [])
    if len(window) != x.rank:
        raise _fail("reduce-window", operands, f"window needs {x.rank} dimensions")
    out = []
    for size, w in zip(x.dims, window):
        dilated = (size - 1) * (w.get("base_dilation", 1) or 1) + 1 if size else 0
        padded = dilated + w.get("padding_low", 0) + w.get("padding_high", 0)
        extent = (w.get("size", 1) - 1) * (w.get("window_dilation", 1) or 1) + 1
        stride = w.get("stride", 1) or 1
        out.append(max(0, (padded - extent) // stride + 1))
    return (init.dtype, tuple(out))
