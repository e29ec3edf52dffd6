"""What every checkpoint reader offers: tensors by Hugging Face name, as numpy arrays.

Subclasses (hf.py, gguf.py) provide ``names``, ``shape``, ``_read`` and ``tokenizer``.
"""

from __future__ import annotations

import pathlib
from typing import Collection

import ml_dtypes
import numpy as np

from decoders.weights.stored import BlockWeight
from runtime.host_memory import aligned_concatenate

# Float types numpy does not know natively; np.dtype(...).kind is "V" for them.
_EXTRA_FLOAT_DTYPES = frozenset(
    np.dtype(t) for t in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)
)


class CheckpointError(ValueError):
    """A checkpoint cannot be opened or read; the message names the file and the fix."""


class MissingTensorError(CheckpointError, KeyError):
    """A tensor the caller asked for is not in the checkpoint.

    It is a ``KeyError`` too, so ``except KeyError`` in mapping-style code still works.
    """

    # KeyError would print the message quoted, as if it were a key.
    __str__ = ValueError.__str__


def is_float_dtype(dtype) -> bool:
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or dtype in _EXTRA_FLOAT_DTYPES


class Checkpoint:
    """One opened checkpoint. Subclasses provide ``names``, ``shape``, ``_read`` and ``tokenizer``."""

    path: pathlib.Path
    config: dict

    def names(self) -> list[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def _read(self, name: str) -> np.ndarray:
        """The tensor in its stored dtype, owning its memory; ``name`` is known to exist."""
        raise NotImplementedError

    def _where(self) -> str:
        """The file(s) a missing tensor was looked for in, for error messages."""
        return str(self.path)

    def tokenizer(self):
        raise NotImplementedError

    def quant_type(self, name: str) -> str | None:
        """The GGML type a GGUF file stores a tensor in (e.g. "Q4_1"); None for other formats."""
        return None

    def block_form(self, name: str) -> str | None:
        """The GGUF block form (a key of BLOCK_FORMS: "q8_0", "q4_k" ...) a tensor is stored in
        and can be read as by blocks(); None: it is read as a float array only."""
        return None

    def blocks(self, name: str) -> BlockWeight:
        """A tensor in its GGUF block form, as stored."""
        raise CheckpointError(f"{self}: {name} is not stored in GGUF blocks")

    def chat_template(self) -> str | None:
        return None

    def rows(self, names: list[str]) -> np.ndarray | None:
        """The tensors, as stored, joined along their first axis (a fused q|k|v from q, k and
        v); None where their element types or trailing dims differ. At most one copy: a reader
        may give a view of its file where they lie there one after another."""
        parts = [self.get(name, keep_dtype=True) for name in names]
        if len(parts) == 1:
            return parts[0]
        if len({p.dtype for p in parts}) > 1 or len({p.shape[1:] for p in parts}) > 1 or parts[0].ndim == 0:
            return None
        return aligned_concatenate(parts)

    def blocks_rows(self, names: list[str]) -> BlockWeight:
        """blocks() of tensors in one block form, each array joined along rows, as rows()."""
        parts = [self.blocks(name) for name in names]
        return BlockWeight(parts[0].form, *(
            None if arrays[0] is None else arrays[0] if len(arrays) == 1 else aligned_concatenate(arrays)
            for arrays in zip(*(part[1:] for part in parts))))

    def release_pages(self, kept: Collection[int] = ()) -> None:
        """Drop the pages of a mapped file that reading has made resident, except those of
        arrays returned at an address in `kept` (the device uses them in place as its buffers).
        A no-op for plain reads."""

    def close(self) -> None:
        pass

    def get(self, name: str, keep_dtype: bool = False) -> np.ndarray:
        """Load one tensor. Float tensors are converted to float32 unless ``keep_dtype``
        (bfloat16 then comes back as ``ml_dtypes.bfloat16``, bit for bit)."""
        self._require(name)
        array = self._read(name)
        if not keep_dtype and is_float_dtype(array.dtype) and array.dtype != np.float32:
            array = array.astype(np.float32)
        return array

    def check_shape(self, name: str, expected_shape) -> None:
        expected = tuple(int(d) for d in expected_shape)
        found = self.shape(name)
        if found != expected:
            raise CheckpointError(f"{name}: expected shape {expected}, checkpoint has {found}")

    def _require(self, name: str) -> None:
        if name not in self:
            raise MissingTensorError(
                f"tensor {name!r} is not in the checkpoint {self._where()} "
                f"({len(self.names())} tensors, e.g. {self.names()[:3]})"
            )

    def __contains__(self, name: str) -> bool:
        return name in self.names()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r})"


