"""Large CPU buffers moved onto 2 MB pages, for the weights a decode step streams.

XLA:CPU copies a host array into memory of its own, on 4 KB pages unless the system makes
every allocation huge (transparent_hugepage=always; the usual setting is madvise). A decode
step reads every weight once, front to back: on 4 KB pages each page costs a TLB miss and
restarts the hardware prefetchers (a bf16 row [2048] is one page). Measured on AMD Zen 4,
one thread streaming 12 bf16 weights of 8192 x 2048 through the matrix-vector kernel: 1.55x
faster on 2 MB pages than on 4 KB ones.

Weights placed straight from a file's mapping (runtime/host_memory.py) stay on its 4 KB
pages: MADV_COLLAPSE cannot move a file's pages here (an ext4 file on Linux 6.18: EINVAL).
Copying them onto 2 MB pages was measured and left out: SmolLM2-1.7B's shape in bf16, two
threads, quiet host: a decode step 105.6 ms from the copies against 111 from the mapping, and
10.3 s to load against 6.0 (copying 3.4 GB, then collapsing it); with other work on the host
the copies' step was half the mapping's (0.13-0.15 against 0.25-0.30 s). Q4_0 blocks with int8
activations: 35 ms a step either way, 1.4 s more to load.

`collapse(buffer)` asks Linux (madvise MADV_COLLAPSE, Linux 6.1 and later) to move the whole
2 MB ranges of a placed buffer onto huge pages, now, whatever the system's setting. Elsewhere,
or where the kernel cannot (no free huge pages), the buffer stays as it is: a slower read,
never a different result.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import sys
from typing import Any

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
