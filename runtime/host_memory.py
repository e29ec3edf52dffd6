"""Host arrays the device can take without a copy, and file mappings that give them.

XLA:CPU uses a host array as the device buffer itself (no copy) when the array starts at a
64-byte boundary; anything else it copies. So the checkpoint readers read into aligned arrays
here, and hand out a tensor that lies aligned in a file as a view of the file's mapping,
which is then placed with no copy at all. (jaxlib 0.10.2 does this whatever device_put's
may_alias says: a placed array must never be written afterwards.)

    array = aligned_empty((rows, cols), np.float32)     # fill it, then place it: one copy in all
    mapped = MappedFile(path)
    view = mapped.view(offset, (rows, cols), dtype)     # read-only; aligned: no copy at all
    mapped.release_copied(kept={buffer_address, ...})   # drop the pages of views not placed as they are

A mapping's pages belong to the page cache: views that the device holds cost no memory of
their own, and those of views already copied (converted, split for tensor parallelism) are
dropped from this process by release_copied(), so they are not counted twice.
"""
from __future__ import annotations

import mmap
import os
from typing import Collection, Sequence

import numpy as np

# The alignment at which XLA:CPU aliases a host array instead of copying it (jaxlib 0.10.2).
ALIGNMENT = 64
PAGE = mmap.PAGESIZE
# Linux 5.14's madvise(MADV_POPULATE_READ): map a range's pages now (from the page cache),
# as llama.cpp's MAP_POPULATE does, rather than fault them in one by one at the first step.
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


def is_aligned(array: np.ndarray) -> bool:
    """True where XLA:CPU can use `array`'s memory as a device buffer (C-contiguous, aligned)."""
    return array.flags.c_contiguous and array.ctypes.data % ALIGNMENT == 0


def aligned_empty(shape: Sequence[int], dtype) -> np.ndarray:
    """An uninitialized C-contiguous array starting at an ALIGNMENT boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def aligned_concatenate(parts: Sequence[np.ndarray]) -> np.ndarray:
    """np.concatenate(parts, axis=0), written once into an aligned array."""
    rows = sum(part.shape[0] for part in parts)
    out = aligned_empty((rows, *parts[0].shape[1:]), np.result_type(*parts))
    np.concatenate(parts, axis=0, out=out)
    return out


class MappedFile:
    """A file mapped read-only, handing out numpy views of it."""

    def __init__(self, path: str | os.PathLike):
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            self._mapping = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) if size else None
        if self._mapping is not None and hasattr(mmap, "MADV_HUGEPAGE"):
            # Pages read in from here on come as 2 MB folios, mapped 2 MB at a time where the
            # file system keeps them so (ext4 on Linux 6.18): a weight streamed from the mapping
            # then reads like one copied onto huge pages. SmolLM2-1.7B's shape in bf16, its
            # pages dropped and read again: 2.2 GB of the 3.3 GB file mapped so without this,
            # 3.2 GB with it, as llama.cpp's mapping of its GGUF was found (3.1 GB).
            try:
                self._mapping.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        # Views handed out since the last release: (address, first byte, end) of each.
        self._views: list[tuple[int, int, int]] = []

    def view(self, offset: int, shape: Sequence[int], dtype) -> np.ndarray:
        """A read-only array of the file's bytes at `offset`, its pages mapped now."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        if count == 0:
            return np.empty(shape, dtype)
        array = np.frombuffer(self._mapping, dtype, count, offset).reshape(shape)
        end = offset + array.nbytes
        first = offset - offset % PAGE
        try:
            self._mapping.madvise(MADV_POPULATE_READ, first, end - first)
        except (OSError, ValueError):   # an older kernel: pages come in at first use instead
            pass
        self._views.append((array.ctypes.data, offset, end))
        return array

    def release_copied(self, kept: Collection[int] = ()) -> None:
        """Drop from this process the pages of the views handed out since the last call, except
        those at an address in `kept` (the device uses them as its buffers). The pages stay in
        the page cache, and come back if a view is read again."""
        for address, begin, end in self._views:
            # Whole pages inside the range only: a neighbour's pages stay.
            first, last = -(-begin // PAGE) * PAGE, end - end % PAGE
            if address not in kept and last > first and hasattr(mmap, "MADV_DONTNEED"):
                self._mapping.madvise(mmap.MADV_DONTNEED, first, last - first)
        self._views = []

    def close(self) -> None:
        """Forget the mapping; it is unmapped once the last view of it is gone (views the
        device holds keep it)."""
        self._mapping = None
        self._views = []
