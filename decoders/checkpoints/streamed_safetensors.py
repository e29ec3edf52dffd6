"""A safetensors file written from a stream of (name, array) pairs, one array in memory at a time.

    write_streamed(path, ((name, checkpoint.get(name)) for name in names), metadata={...})

safetensors' own save_file takes every tensor at once (a whole widened model in memory);
here each array goes to a body file as it comes, and the header, known only at the end,
is then written before the body (the format puts it first).
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
from typing import Iterable

import ml_dtypes
import numpy as np

_NAMES = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
          np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.int64): "I64", np.dtype(np.int32): "I32",
          np.dtype(np.int16): "I16", np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8",
          np.dtype(np.bool_): "BOOL"}


def write_streamed(path: str | os.PathLike, tensors: Iterable[tuple[str, np.ndarray]],
                   metadata: dict[str, str] | None = None) -> None:
    """Write `tensors` (asked for one at a time) to a safetensors file at `path`."""
    path = pathlib.Path(path)
    body = path.with_name(path.name + ".body")
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    try:
        with open(body, "wb") as f:
            for name, array in tensors:
                array = np.ascontiguousarray(array)
                if array.dtype not in _NAMES:
                    raise ValueError(f"{name}: safetensors has no type for {array.dtype}")
                header[name] = {"dtype": _NAMES[array.dtype], "shape": list(array.shape),
                                "data_offsets": [offset, offset + array.nbytes]}
                f.write(array.reshape(-1).view(np.uint8).data)
                offset += array.nbytes
                del array
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)          # the format pads the header with spaces
        with open(path, "wb") as out, open(body, "rb") as data:
            out.write(np.uint64(len(encoded)).astype("<u8").tobytes())
            out.write(encoded)
            shutil.copyfileobj(data, out, 1 << 24)
    finally:
        body.unlink(missing_ok=True)
