"""The scribe: Python functions that write XLA HloModuleProto.

    def program(scribe):
        f32 = scribe.f32
        a = f32[4, 8].Parameter(parameter_number=0)
        b = f32[4, 8].Parameter(parameter_number=1)
        return f32[4, 8].Add(a, b)

    proto = compile_py_func(program)

Ops are methods of the result shape; keyword arguments map onto
HloInstructionProto fields; a sub-computation is a Python function of the
scribe (`to_apply=add`). `compile_py_func` checks and finishes the module:
ids, unique names, program shapes, layouts, computation order and aliasing.
"""
from __future__ import annotations

import os
import re
import sys
from typing import Any, Callable, Sequence

from google.protobuf import json_format

from pyhlo import dtypes
from pyhlo.literals import literal
from pyhlo.opcodes import opcode_of as opcode_of  # kept importable as pyhlo.scribe.opcode_of
from pyhlo.schema import hlo_pb2
from pyhlo.shape_inference import HloShapeError, expected_shape
from pyhlo.shapes import ArrayShape, DType, Shape, TupleShape

_PYHLO_DIR = os.path.dirname(os.path.abspath(__file__))

_HLO_FIELDS = set(hlo_pb2.HloInstructionProto.DESCRIPTOR.fields_by_name)
_COMPUTATION_ARGS = ("to_apply", "condition", "body", "true_computation", "false_computation",
                     "comparator", "branch_computations")


def _in_pyhlo(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_PYHLO_DIR + os.sep)


class HloValue:
    """The result of one instruction: its shape, and its place in the program."""

    def __init__(self, scribe: Scribe, proto: hlo_pb2.HloInstructionProto, shape: Shape,
                 computation: _ComputationBuilder):
        self.scribe = scribe
        self.proto = proto
        self.shape = shape
        self.computation = computation

    @property
    def id(self) -> int:
        return self.proto.id

    @property
    def name(self) -> str:
        return self.proto.name

    @property
    def opcode(self) -> str:
        return self.proto.opcode

    @property
    def dtype(self) -> str:
        return self.shape.dtype  # type: ignore[attr-defined]

    @property
    def dims(self) -> tuple[int, ...]:
        return self.shape.dims  # type: ignore[attr-defined]

    def set_alias_to(self, parameter: HloValue, must: bool = False) -> HloValue:
        """Declare that this output reuses `parameter`'s buffer (updated in place).

        At run time the argument is donated: the caller's buffer is consumed.
        """
        self.scribe.aliases.append((self, parameter, must))
        return self

    def __repr__(self) -> str:
        return f"<{self.name} = {self.shape!r} {self.opcode}>"


class _ComputationBuilder:
    def __init__(self, scribe: Scribe, name: str):
        self.scribe = scribe
        self.name = name
        self.id = scribe.next_id()
        self.instructions: list[hlo_pb2.HloInstructionProto] = []
        self.parameters: dict[int, HloValue] = {}

    def finish(self, root: HloValue) -> hlo_pb2.HloComputationProto:
        if not isinstance(root, HloValue):
            raise TypeError(f"computation {self.name!r} must return an HloValue, got {type(root).__name__}")
        if root.computation is not self:
            raise HloShapeError(f"computation {self.name!r} returns a value built in another computation")
        numbers = sorted(self.parameters)
        if numbers != list(range(len(numbers))):
            raise HloShapeError(
                f"computation {self.name!r}: parameter numbers {numbers} must be 0..{len(numbers) - 1} with "
                "no gaps"
            )
        program_shape = hlo_pb2.ProgramShapeProto(result=root.shape.to_proto())
        for n in numbers:
            program_shape.parameters.append(self.parameters[n].shape.to_proto())
            program_shape.parameter_names.append(self.parameters[n].name)
        return hlo_pb2.HloComputationProto(
            name=self.name, id=self.id, root_id=root.id,
            instructions=self.instructions, program_shape=program_shape,
        )


# XLA's PrecisionConfig.Precision names, as pyhlo spells them.
DOT_PRECISIONS = ("default", "high", "highest")


class Scribe:
    """Writes one HLO module. Element types are attributes: `scribe.f32[4, 8]`."""

    def __init__(self, record_source: bool = True, f32_dot_precision: str = "highest"):
        self.record_source = record_source
        # The precision of f32 dots that do not name their own (raw `Dot` or dot_general):
        # "highest" keeps f32 products exact in f32 on every platform (GPUs would otherwise
        # use TF32); "high" or "default" lets the compiler trade precision for speed.
        self.f32_dot_precision = check_precision(f32_dot_precision)
        self.aliases: list[tuple[HloValue, HloValue, bool]] = []
        self.computations: list[hlo_pb2.HloComputationProto] = []
        self._stack: list[_ComputationBuilder] = []
        self._built: dict[Any, int] = {}
        self._names: set[str] = set()
        self._suffixes: dict[str, int] = {}
        self._counter = 0
        for name in dtypes.ELEMENT_TYPES:
            setattr(self, name, DType(self, name))

    def next_id(self) -> int:
        self._counter += 1
        return self._counter

    def unique_name(self, base: str) -> str:
        base = re.sub(r"[^A-Za-z0-9_.\-]", "_", base) or "x"
        # The suffix search starts where this base's last one ended (from 1 it was quadratic in
        # the uses of a base: a 1.7 B decode step has thousands of "add"s).
        n = self._suffixes.get(base, 1)
        name = base if n == 1 else f"{base}.{n}"
        while name in self._names:
            n += 1
            name = f"{base}.{n}"
        self._suffixes[base] = n
        self._names.add(name)
        return name

    def tuple(self, *shapes: Shape) -> TupleShape:
        """A tuple shape, e.g. `scribe.tuple(f32[4], s32[4]).Tuple(values, indices)`."""
        return TupleShape(self, tuple(shapes))

    # -- building computations -------------------------------------------------
    def build_computation(self, fn: Callable[[Scribe], Any], name: str | None = None) -> int:
        """Run `fn(scribe)` as a new computation; its callees are listed before it."""
        if fn in self._built:
            return self._built[fn]
        builder = _ComputationBuilder(self, self.unique_name(name or getattr(fn, "__name__", "computation")))
        self._stack.append(builder)
        try:
            root = fn(self)
            if isinstance(root, (list, tuple)):
                root = self.tuple(*(v.shape for v in root)).Tuple(*root)
        finally:
            self._stack.pop()
        self.computations.append(builder.finish(root))
        builder.root = root  # type: ignore[attr-defined]
        self._built[fn] = builder.id
        self._last_builder = builder
        return builder.id

    def add_instruction(self, opcode: str, shape: Shape, operands: Sequence[HloValue],
                        attributes: dict[str, Any]) -> HloValue:
        if not self._stack:
            raise RuntimeError("ops can only be written inside compile_py_func(fn)")
        builder = self._stack[-1]
        for i, operand in enumerate(operands):
            if not isinstance(operand, HloValue):
                raise TypeError(f"{opcode}: operand {i} is a {type(operand).__name__}, not an HloValue")
            if operand.computation is not builder:
                raise HloShapeError(f"{opcode}: operand {operand.name} belongs to another computation")
        attributes = dict(attributes)
        name = attributes.pop("name", None) or attributes.pop("parameter_name", None) or (
            f"p{attributes.get('parameter_number')}" if opcode == "parameter" else opcode
        )
        proto = hlo_pb2.HloInstructionProto(opcode=opcode, id=self.next_id(), shape=shape.to_proto())
        proto.operand_ids.extend(o.id for o in operands)
        self._set_computations(proto, attributes)
        if opcode == "compare":
            attributes.setdefault("comparison_type", dtypes.comparison_type(operands[0].dtype))
        if opcode == "constant":
            if "constant_value" not in attributes:
                raise HloShapeError("constant: needs constant_value=")
            proto.literal.CopyFrom(literal(shape, attributes.pop("constant_value")))  # type: ignore[arg-type]
        if opcode == "parameter":
            self._add_parameter(builder, proto, attributes)
        if opcode == "dot" and "precision_config" not in attributes:
            self._default_dot_precision(operands, attributes)
        self._check_shape(opcode, shape, operands, attributes)
        self._set_fields(opcode, proto, attributes)
        proto.name = self.unique_name(name)
        if self.record_source:
            self._set_source(proto)
        builder.instructions.append(proto)
        value = HloValue(self, proto, shape, builder)
        if opcode == "parameter":
            builder.parameters[proto.parameter_number] = value
        return value

    def _default_dot_precision(self, operands: Sequence[HloValue], attributes: dict) -> None:
        """An f32 dot that names no precision takes the module's f32_dot_precision."""
        if self.f32_dot_precision != "default" and any(o.dtype == "f32" for o in operands):
            attributes["precision_config"] = {"operand_precision": [self.f32_dot_precision.upper()] * 2}

    def _add_parameter(self, builder: _ComputationBuilder, proto, attributes: dict) -> None:
        number = attributes.get("parameter_number")
        if not isinstance(number, int) or number < 0:
            raise HloShapeError("parameter: needs parameter_number=N with N >= 0")
        if number in builder.parameters:
            raise HloShapeError(f"parameter: number {number} is used twice in {builder.name!r}")

    def _set_computations(self, proto, attributes: dict) -> None:
        for key in _COMPUTATION_ARGS:
            if key not in attributes:
                continue
            value = attributes.pop(key)
            fns = value if key == "branch_computations" else [value]
            for fn in fns:
                proto.called_computation_ids.append(self.build_computation(fn))

    def _check_shape(self, opcode: str, shape: Shape, operands, attributes) -> None:
        expected = expected_shape(opcode, shape, operands, attributes)
        if expected is None:
            return
        if isinstance(expected, TupleShape):
            ok = shape.same_as(expected)  # type: ignore[attr-defined]
            want = repr(expected)
        else:
            dtype, dims = expected
            ok = isinstance(shape, ArrayShape) and shape.dims == dims and dtype in (None, shape.dtype)
            want = f"{dtype or '<any type>'}[{','.join(map(str, dims))}]"
        if not ok:
            operand_shapes = ", ".join(repr(o.shape) for o in operands)
            raise HloShapeError(
                f"{opcode}: result declared as {shape!r} but operands ({operand_shapes}) give {want}"
            )

    @staticmethod
    def _set_fields(opcode: str, proto, attributes: dict) -> None:
        for key, value in attributes.items():
            if key not in _HLO_FIELDS:
                raise TypeError(f"{opcode}: unknown attribute {key!r} (not an HloInstructionProto field)")
            field = proto.DESCRIPTOR.fields_by_name[key]
            if key == "replica_groups":
                for group in value:
                    ids = group if isinstance(group, (list, tuple)) else group["replica_ids"]
                    proto.replica_groups.add(replica_ids=list(ids))
            elif field.message_type is not None and field.is_repeated:
                for item in value:
                    json_format.ParseDict(item, getattr(proto, key).add())
            elif field.message_type is not None:
                json_format.ParseDict(value, getattr(proto, key))
            elif field.is_repeated:
                getattr(proto, key).extend(value)
            else:
                setattr(proto, key, value)

    @staticmethod
    def _set_source(proto) -> None:
        frame = sys._getframe(3)
        # Skip the scribe and the op library (pyhlo/ and its subpackages): point at the writer.
        while frame is not None and _in_pyhlo(frame.f_code.co_filename):
            frame = frame.f_back
        if frame is not None:
            proto.metadata.source_file = os.path.basename(frame.f_code.co_filename)
            proto.metadata.source_line = frame.f_lineno
            proto.metadata.op_name = frame.f_code.co_name

    # -- finishing the module ------------------------------------------------
    def finish_module(self, name: str, entry_id: int) -> hlo_pb2.HloModuleProto:
        entry = self.computations[-1]
        module = hlo_pb2.HloModuleProto(
            name=name, entry_computation_name=entry.name, entry_computation_id=entry_id,
            computations=self.computations, id=self.next_id(),
        )
        module.host_program_shape.CopyFrom(entry.program_shape)
        self._write_aliases(module, self._last_builder)
        return module

    def _write_aliases(self, module, entry: _ComputationBuilder) -> None:
        root = entry.root  # type: ignore[attr-defined]
        taken: set[tuple[int, ...]] = set()
        aliased_parameters: set[int] = set()
        for value, parameter, must in self.aliases:
            if parameter.opcode != "parameter" or parameter.computation is not entry:
                raise HloShapeError(f"bad alias: {parameter.name} is not a parameter of the entry "
                                    "computation")
            if parameter.proto.parameter_number in aliased_parameters:
                raise HloShapeError(f"bad alias: parameter {parameter.name} is aliased twice")
            if root.opcode == "tuple":
                indices = [(i,) for i, op_id in enumerate(root.proto.operand_ids) if op_id == value.id]
            else:
                indices = [()] if root is value else []
            indices = [i for i in indices if i not in taken]
            if not indices:
                raise HloShapeError(f"bad alias: {value.name} is not an output of the entry computation")
            if not value.shape.same_as(parameter.shape):  # type: ignore[attr-defined]
                raise HloShapeError(
                    f"bad alias: output {value.name} {value.shape!r} and parameter "
                    f"{parameter.name} {parameter.shape!r} differ in shape"
                )
            taken.add(indices[0])
            aliased_parameters.add(parameter.proto.parameter_number)
            module.input_output_alias.entries.add(
                output_shape_index=list(indices[0]),
                parameter_number=parameter.proto.parameter_number,
                kind=hlo_pb2.MUST_ALIAS if must else hlo_pb2.MAY_ALIAS,
            )


def check_precision(precision: str) -> str:
    """An XLA dot precision name ("highest", "high", "default"), lower-cased; else ValueError."""
    name = precision.lower() if isinstance(precision, str) else precision
    if name not in DOT_PRECISIONS:
        raise ValueError(f"unknown dot precision {precision!r}; valid: {', '.join(DOT_PRECISIONS)}")
    return name


def compile_py_func(fn: Callable[[Scribe], Any], name: str | None = None,
                    record_source: bool = True, f32_dot_precision: str = "highest") -> hlo_pb2.HloModuleProto:
    """Write the HLO module whose entry computation is `fn(scribe)`.

    `fn` returns its result: one value, or a list/tuple of values (made a tuple).
    `f32_dot_precision`: the precision of its f32 dots (Scribe).
    """
    scribe = Scribe(record_source=record_source, f32_dot_precision=f32_dot_precision)
    entry_id = scribe.build_computation(fn, name=getattr(fn, "__name__", "main"))
    return scribe.finish_module(name or getattr(fn, "__name__", "module"), entry_id)
