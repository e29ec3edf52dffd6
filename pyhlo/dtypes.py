"""Element types: XLA primitive types, their names, sizes and numpy equivalents."""
from __future__ import annotations

import numpy as np

from pyhlo.schema import hlo_pb2

try:  # ml_dtypes ships with jaxlib; it gives numpy a bfloat16.
    import ml_dtypes

    _BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - only without jaxlib
    _BF16 = None

# name -> (primitive type enum, byte size, numpy dtype)
ELEMENT_TYPES: dict[str, tuple[int, int, np.dtype | None]] = {
    "pred": (hlo_pb2.PRED, 1, np.dtype(np.bool_)),
    "s8": (hlo_pb2.S8, 1, np.dtype(np.int8)),
    "u8": (hlo_pb2.U8, 1, np.dtype(np.uint8)),
    "s16": (hlo_pb2.S16, 2, np.dtype(np.int16)),
    "u16": (hlo_pb2.U16, 2, np.dtype(np.uint16)),
    "s32": (hlo_pb2.S32, 4, np.dtype(np.int32)),
    "u32": (hlo_pb2.U32, 4, np.dtype(np.uint32)),
    "s64": (hlo_pb2.S64, 8, np.dtype(np.int64)),
    "u64": (hlo_pb2.U64, 8, np.dtype(np.uint64)),
    "f16": (hlo_pb2.F16, 2, np.dtype(np.float16)),
    "bf16": (hlo_pb2.BF16, 2, _BF16),
    "f32": (hlo_pb2.F32, 4, np.dtype(np.float32)),
    "f64": (hlo_pb2.F64, 8, np.dtype(np.float64)),
}

FLOAT_TYPES = frozenset({"f16", "bf16", "f32", "f64"})
SIGNED_TYPES = frozenset({"s8", "s16", "s32", "s64"})
UNSIGNED_TYPES = frozenset({"u8", "u16", "u32", "u64"})
INTEGER_TYPES = SIGNED_TYPES | UNSIGNED_TYPES

NAME_OF_PRIMITIVE = {enum: name for name, (enum, _, _) in ELEMENT_TYPES.items()}


def primitive_type(name: str) -> int:
    return ELEMENT_TYPES[name][0]


def byte_size(name: str) -> int:
    return ELEMENT_TYPES[name][1]


def numpy_dtype(name: str) -> np.dtype:
    dtype = ELEMENT_TYPES[name][2]
    if dtype is None:
        raise RuntimeError(f"numpy has no {name} without the ml_dtypes package")
    return dtype


def name_of_numpy(dtype: np.dtype) -> str:
    """The element type name of a numpy dtype, e.g. float32 -> 'f32'."""
    dtype = np.dtype(dtype)
    for name, (_, _, np_dtype) in ELEMENT_TYPES.items():
        if np_dtype is not None and np_dtype == dtype:
            return name
    raise ValueError(f"numpy dtype {dtype} has no XLA element type")


def comparison_type(name: str) -> str:
    """The comparison_type XLA expects for compare on this element type."""
    if name in FLOAT_TYPES:
        return "FLOAT"
    if name in SIGNED_TYPES:
        return "SIGNED"
    return "UNSIGNED"


# Names an `amp` setting may take (pyhlo's element type names and torch's), by element type.
AMP_TYPES = {"f32": "f32", "float32": "f32", "bf16": "bf16", "bfloat16": "bf16",
             "f16": "f16", "float16": "f16"}


def element_type_of_amp(amp: str) -> str:
    """'f32' | 'bf16' | 'f16' (or torch names) -> element type name; anything else is an error."""
    try:
        return AMP_TYPES[amp]
    except (KeyError, TypeError):
        raise ValueError(f"unknown amp {amp!r}; use one of 'f32', 'bf16', 'f16'") from None
