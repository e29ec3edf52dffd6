"""Large CPU buffers moved onto 2 MB pages, for the weights a decode step streams.

A CPU buffer lies on 4 KB pages unless the system makes every allocation huge
(transparent_hugepage=always; the usual setting is madvise). A decode
step reads every weight once, front to back: on 4 KB pages each page costs a TLB miss and
restarts the hardware prefetchers (a bf16 row [2048] is one page). Measured on AMD Zen 4,
one thread streaming 12 bf16 weights of 8192 x 2048 through the matrix-vector kernel: 1.55x
faster on 2 MB pages than on 4 KB ones.

Weights read straight from a file's mapping (runtime/host_memory.py) lie in the page cache,
on 4 KB pages that MADV_COLLAPSE cannot move (an ext4 file on Linux 6.18: EINVAL). Measured
on the same host, SmolLM2-1.7B's shape in bf16, two threads: a decode step 0.25-0.30 s from
the mapping, 0.13-0.15 s from copies on 2 MB pages (prefill 1.7x faster too); Q4_0 blocks
with int8 activations, whose kernel does more work a byte, showed no gain. So
`off_the_mapping(array)` copies a float weight that lies in a mapping into anonymous memory
at a 2 MB boundary, where huge pages can be had; block weights stay in the mapping (no copy,
less load time).

`collapse(buffer)` asks Linux (madvise MADV_COLLAPSE, Linux 6.1 and later) to move the whole
2 MB ranges of a placed buffer onto huge pages, now, whatever the system's setting. Elsewhere,
or where the kernel cannot (no free huge pages), the buffer stays as it is: a slower read,
never a different result.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import sys
from typing import Any

import numpy as np

HUGE_PAGE = 2 << 20
MADV_COLLAPSE = 25   # <linux/mman.h>

log = logging.getLogger("pyhlo")


@functools.lru_cache(maxsize=1)
def _madvise() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """True where this kernel moves anonymous memory onto 2 MB pages (tried once, on 4 MB)."""
    madvise = _madvise()
    if madvise is None:
        return False
    probe = np.ones(2 * HUGE_PAGE + HUGE_PAGE, np.uint8)
    start = -(-probe.ctypes.data // HUGE_PAGE) * HUGE_PAGE
    return madvise(start, 2 * HUGE_PAGE, MADV_COLLAPSE) == 0


def _in_a_mapping(array: np.ndarray) -> bool:
    """True where the array's memory is a file's mapping (a view of an mmap.mmap)."""
    base = array
    while base is not None:
        if isinstance(base, mmap.mmap) or (isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap)):
            return True
        base = getattr(base, "base", None)
    return False


_FLOATS = ("float32", "float16", "bfloat16")


def off_the_mapping(array: Any) -> Any:
    """A float weight of at least 2 MB lying in a file's mapping, copied into memory of its
    own at a 2 MB boundary (which collapse() can then move onto huge pages), where huge pages
    can be had; anything else as it is."""
    if (not isinstance(array, np.ndarray) or array.dtype.name not in _FLOATS or array.nbytes < HUGE_PAGE
            or not _in_a_mapping(array) or not available()):
        return array
    raw = np.empty(array.nbytes + HUGE_PAGE, np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE
    copy = raw[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
    np.copyto(copy, array)
    return copy


def collapse(buffer: Any) -> bool:
    """Move the whole 2 MB ranges of a CPU device buffer onto huge pages (waits for the
    buffer's copy to finish first). False where nothing was moved."""
    madvise = _madvise()
    if madvise is None or buffer.nbytes < HUGE_PAGE:
        return False
    buffer.block_until_ready()   # the copy into the buffer may still be running
    address = buffer.unsafe_buffer_pointer()
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + buffer.nbytes) // HUGE_PAGE * HUGE_PAGE
    if end <= start:
        return False
    if madvise(start, end - start, MADV_COLLAPSE) != 0:
        log.debug("weights stay on 4 KB pages: madvise(MADV_COLLAPSE) failed with errno %d",
                  ctypes.get_errno())
        return False
    return True
