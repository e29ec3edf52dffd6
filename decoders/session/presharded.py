"""Presharded weights: each replica's parameters exactly as it holds them (the program's
layout, element type and that replica's part), one safetensors file per replica.

    directory/weights/rank{r}.safetensors     tensors "shared/NAME" and "layer{i}/NAME"

Loading them places each tensor as it is, straight from the file's mapping (its tensors start
at a 64-byte boundary): no checkpoint reading, no transposing, converting or sharding.
"""
from __future__ import annotations

import pathlib
from typing import Callable, Collection, Sequence

import numpy as np

from decoders.checkpoints.hf import _SafetensorsShard
from decoders.checkpoints.streamed_safetensors import aligned_header

FILES = "weights/rank{rank}.safetensors"
_NAMES = {np.dtype(dtype): name for name, dtype in _SafetensorsShard._DTYPES.items()}


def tensor_name(name: str, layer: int | None) -> str:
    return f"shared/{name}" if layer is None else f"layer{layer}/{name}"


def rank_file(directory: str | pathlib.Path, rank: int) -> pathlib.Path:
    return pathlib.Path(directory) / FILES.format(rank=rank)


def write(path: pathlib.Path, tensors: Sequence[tuple[str, np.dtype, tuple[int, ...]]],
          fetch: Callable[[str], np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """A safetensors file of `tensors` (name, dtype, shape), each array asked of `fetch` only
    when it is written: one tensor in memory at a time."""
    header: dict = {"__metadata__": dict(metadata or {})}
    offset = 0
    for name, dtype, shape in tensors:
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": _NAMES[np.dtype(dtype)], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(aligned_header(header))
        for name, dtype, shape in tensors:
            array = np.asarray(fetch(name))
            if array.dtype != np.dtype(dtype) or tuple(array.shape) != tuple(shape):
                raise ValueError(f"{name}: the device holds {array.dtype}{list(array.shape)}, "
                                 f"the program declares {np.dtype(dtype)}{list(shape)}")
            f.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)


class RankFile:
    """One replica's file, read one tensor at a time and checked against what the program takes."""

    def __init__(self, path: pathlib.Path):
        if not path.exists():
            raise ValueError(f"{path} is missing: the directory's presharded weights are incomplete")
        self.path = path
        self._file = _SafetensorsShard(path)
        self._shapes = self._file.shapes()

    def read(self, name: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self._shapes:
            raise ValueError(f"{self.path} has no tensor {name!r}: it was saved for another model")
        array = self._file.read(name)
        if array.dtype != np.dtype(dtype) or tuple(array.shape) != tuple(shape):
            raise ValueError(f"{self.path}: {name} is {array.dtype}{list(array.shape)}, this model's program "
                             f"takes {np.dtype(dtype)}{list(shape)}")
        return array

    def release_pages(self, kept: Collection[int] = ()) -> None:
        self._file.release_pages(kept)
