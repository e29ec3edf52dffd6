"""Calls of kernels registered with XLA through its typed FFI (custom-call API version 4)."""
from __future__ import annotations

from google.protobuf import json_format

from pyhlo.scribe import HloValue
from pyhlo.shapes import Shape


def ffi_call(shape: Shape, operands: list[HloValue], target: str) -> HloValue:
    """A custom call of `target` whose result and operands keep row-major layouts.

    A kernel reads and writes its buffers row-major; without the constraint XLA may give the
    call another layout (e.g. column-major for a [2, n] result feeding an all-gather along n)
    and read the kernel's rows as columns.
    """
    layouts = [json_format.MessageToDict(o.shape.to_proto(), preserving_proto_field_name=True)
               for o in operands]
    return shape.CustomCall(*operands, custom_call_target=target, custom_call_api_version=4,
                            backend_config=b"{}", constrain_layout=True, operand_shapes_with_layout=layouts)
