"""Shapes: an element type with dimensions, or a tuple of shapes.

`scribe.f32[4, 8]` is an ArrayShape; ops are methods of the result shape
(`scribe.f32[4, 8].Add(a, b)`), so every instruction states its output type
where it is written.
"""
from __future__ import annotations

import math
from typing import Any, Protocol, Sequence

from pyhlo import dtypes
from pyhlo.opcodes import opcode_of
from pyhlo.schema import hlo_pb2


class InstructionWriter(Protocol):
    """What a shape needs of its scribe (a pyhlo.scribe.Scribe): writing an instruction.

    Named here instead of Scribe because the scribe module imports this one.
    """

    def add_instruction(self, opcode: str, shape: Shape, operands: Sequence[Any],
                        attributes: dict[str, Any]) -> Any: ...


class Shape:
    scribe: InstructionWriter

    def to_proto(self) -> hlo_pb2.ShapeProto:
        raise NotImplementedError

    def __getattr__(self, op_name: str) -> Any:
        # Op methods are CamelCase names of HLO opcodes: Add, DynamicUpdateSlice...
        if not op_name[:1].isupper():
            raise AttributeError(op_name)
        opcode = opcode_of(op_name)

        def build(*operands: Any, **attributes: Any) -> Any:
            return self.scribe.add_instruction(opcode, self, operands, attributes)

        build.__name__ = op_name
        return build


class ArrayShape(Shape):
    """An array of `dtype` elements with static dimensions, row-major."""

    def __init__(self, scribe: InstructionWriter, dtype: str, dims: tuple[int, ...]):
        for d in dims:
            if not isinstance(d, int) or isinstance(d, bool) or d < 0:
                raise ValueError(f"{dtype}{list(dims)}: dimensions must be non-negative ints")
        self.scribe = scribe
        self.dtype = dtype
        self.dims = tuple(int(d) for d in dims)

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def num_elements(self) -> int:
        return math.prod(self.dims)

    @property
    def byte_size(self) -> int:
        return self.num_elements * dtypes.byte_size(self.dtype)

    def to_proto(self) -> hlo_pb2.ShapeProto:
        proto = hlo_pb2.ShapeProto(
            element_type=dtypes.primitive_type(self.dtype), dimensions=self.dims
        )
        proto.layout.minor_to_major.extend(reversed(range(self.rank)))
        return proto

    def same_as(self, other: Shape) -> bool:
        return isinstance(other, ArrayShape) and (self.dtype, self.dims) == (
            other.dtype,
            other.dims,
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ArrayShape) and self.same_as(other)

    def __hash__(self) -> int:
        return hash((self.dtype, self.dims))

    def __repr__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


class TupleShape(Shape):
    def __init__(self, scribe: InstructionWriter, elements: tuple[Shape, ...]):
        self.scribe = scribe
        self.elements = tuple(elements)

    def to_proto(self) -> hlo_pb2.ShapeProto:
        proto = hlo_pb2.ShapeProto(element_type=hlo_pb2.TUPLE)
        for element in self.elements:
            proto.tuple_shapes.append(element.to_proto())
        return proto

    @property
    def byte_size(self) -> int:
        return sum(e.byte_size for e in self.elements)  # type: ignore[attr-defined]

    def same_as(self, other: Shape) -> bool:
        return (
            isinstance(other, TupleShape)
            and len(other.elements) == len(self.elements)
            and all(a.same_as(b) for a, b in zip(self.elements, other.elements))  # type: ignore[attr-defined]
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TupleShape) and self.same_as(other)

    def __hash__(self) -> int:
        return hash(self.elements)

    def __repr__(self) -> str:
        return "(" + ", ".join(map(repr, self.elements)) + ")"


class DType:
    """An element type bound to a scribe: `f32[4, 8]` makes a shape, `f32.Constant(...)` a scalar."""

    def __init__(self, scribe: InstructionWriter, name: str):
        self.scribe = scribe
        self.name = name

    def __getitem__(self, dims: Any) -> ArrayShape:
        if dims == () or dims == []:
            dims = ()
        elif isinstance(dims, int):
            dims = (dims,)
        elif isinstance(dims, list):
            dims = tuple(dims)
        return ArrayShape(self.scribe, self.name, tuple(dims))

    @property
    def scalar(self) -> ArrayShape:
        return self[()]

    def __getattr__(self, op_name: str) -> Any:
        # Ops on the dtype itself build scalars: f32.Constant(constant_value=1.0).
        if not op_name[:1].isupper():
            raise AttributeError(op_name)
        return getattr(self.scalar, op_name)

    def __repr__(self) -> str:
        return self.name


def shape_from_proto(scribe: InstructionWriter, proto: hlo_pb2.ShapeProto) -> Shape:
    if proto.element_type == hlo_pb2.TUPLE:
        return TupleShape(scribe, tuple(shape_from_proto(scribe, s) for s in proto.tuple_shapes))
    return ArrayShape(scribe, dtypes.NAME_OF_PRIMITIVE[proto.element_type], tuple(proto.dimensions))
