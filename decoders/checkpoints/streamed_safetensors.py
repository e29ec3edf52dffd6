"""A safetensors file written from a stream of (name, array) pairs, one array in memory at a time.

    write_streamed(path, ((name, checkpoint.get(name)) for name in names), metadata={...})

safetensors' own save_file takes every tensor at once (a whole widened model in memory);
here each array goes to a body file as it comes, and the header, known only at the end,
is then written before the body (the format puts it first).

The header is padded so that the tensors start at a 64-byte boundary of the file: a tensor
whose offset is a multiple of 64 is then placed straight from the file's mapping
(runtime/host_memory.py). `group` sorts tensors into runs, kept in the order asked within
each: grouping a block weight's values apart from its scales lets the values of q, k and v
lie one after another, to be read as one fused weight with no copy.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
from typing import BinaryIO, Callable, Iterable

import ml_dtypes
import numpy as np

from runtime.host_memory import ALIGNMENT

_NAMES = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
          np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.int64): "I64", np.dtype(np.int32): "I32",
          np.dtype(np.int16): "I16", np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8",
          np.dtype(np.bool_): "BOOL"}


def write_streamed(path: str | os.PathLike, tensors: Iterable[tuple[str, np.ndarray]],
                   metadata: dict[str, str] | None = None, group: Callable[[str], int] | None = None) -> None:
    """Write `tensors` (asked for one at a time) to a safetensors file at `path`, in runs by
    group(name) (from the lowest), each run in the order given."""
    path = pathlib.Path(path)
    bodies: dict[int, tuple[pathlib.Path, BinaryIO]] = {}
    entries: dict[int, list[tuple[str, dict, int]]] = {}
    try:
        for name, array in tensors:
            array = np.ascontiguousarray(array)
            if array.dtype not in _NAMES:
                raise ValueError(f"{name}: safetensors has no type for {array.dtype}")
            run = group(name) if group is not None else 0
            if run not in bodies:
                body = path.with_name(f"{path.name}.body{run}")
                bodies[run] = (body, open(body, "wb"))
                entries[run] = []
            entries[run].append((name, {"dtype": _NAMES[array.dtype], "shape": list(array.shape)},
                                 array.nbytes))
            bodies[run][1].write(array.reshape(-1).view(np.uint8).data)
            del array
        for _, f in bodies.values():
            f.close()
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        offset = 0
        for run in sorted(entries):
            for name, entry, nbytes in entries[run]:
                header[name] = {**entry, "data_offsets": [offset, offset + nbytes]}
                offset += nbytes
        with open(path, "wb") as out:
            out.write(aligned_header(header))
            for run in sorted(bodies):
                with open(bodies[run][0], "rb") as data:
                    shutil.copyfileobj(data, out, 1 << 24)
    finally:
        for body, f in bodies.values():
            f.close()
            body.unlink(missing_ok=True)


def aligned_header(header: dict) -> bytes:
    """The 8-byte length and the JSON header, padded with spaces (as the format allows) so that
    the tensors start at an ALIGNMENT boundary of the file."""
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-(8 + len(encoded)) % ALIGNMENT)
    return np.uint64(len(encoded)).astype("<u8").tobytes() + encoded
