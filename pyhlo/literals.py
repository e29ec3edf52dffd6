"""Constants: numpy values encoded as XLA LiteralProto."""
from __future__ import annotations

import numpy as np

from pyhlo import dtypes
from pyhlo.schema import hlo_pb2
from pyhlo.shapes import ArrayShape

# element type -> (LiteralProto field, stored as bytes?)
_FIELDS = {
    "pred": ("preds", False),
    "s8": ("s8s", True),
    "u8": ("u8s", True),
    "s16": ("s16s", True),
    "u16": ("u16s", True),
    "s32": ("s32s", False),
    "u32": ("u32s", False),
    "s64": ("s64s", False),
    "u64": ("u64s", False),
    "f16": ("f16s", True),
    "bf16": ("bf16s", True),
    "f32": ("f32s", False),
    "f64": ("f64s", False),
}


def literal(shape: ArrayShape, value) -> hlo_pb2.LiteralProto:
    """Encode `value` (a scalar, nested list or numpy array) as a literal of `shape`.

    A scalar value fills the whole shape; an array must have exactly its dims.
    """
    np_dtype = dtypes.numpy_dtype(shape.dtype)
    array = np.asarray(value)
    if array.shape == () and shape.dims != ():
        array = np.full(shape.dims, array)
    if array.shape != shape.dims:
        raise ValueError(f"constant for {shape!r} has shape {list(array.shape)}")
    if array.dtype.kind == "f" and np_dtype.kind in "iub":
        if not np.all(np.isfinite(array)) or np.any(array != np.round(array)):
            raise ValueError(f"constant for {shape!r} holds non-integer values")
    array = np.ascontiguousarray(array.astype(np_dtype))
    proto = hlo_pb2.LiteralProto(shape=shape.to_proto())
    field, as_bytes = _FIELDS[shape.dtype]
    if as_bytes:
        setattr(proto, field, array.astype(array.dtype.newbyteorder("<")).tobytes())
    else:
        getattr(proto, field).extend(array.ravel().tolist())
    return proto
