"""Weights on 2 MB pages (runtime/huge_pages.py): placed weights keep their values, and a
buffer reported moved lies on huge pages."""
from __future__ import annotations

import numpy as np
import pytest

from runtime import get_backend, huge_pages
from runtime.placement import Placement

pytestmark = pytest.mark.cpu_only


def huge_kb_in(start: int, end: int) -> int:
    """AnonHugePages (kB) of the mappings of this process overlapping [start, end)."""
    total, overlaps = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(" ", 1)[0]
            if "-" in first and ":" not in first:
                low, high = (int(v, 16) for v in first.split("-"))
                overlaps = low < end and start < high
            elif overlaps and line.startswith("AnonHugePages:"):
                total += int(line.split()[1])
    return total


def test_streamed_weight_keeps_its_values_and_lies_on_huge_pages():
    backend = get_backend()
    probe = backend.to_device(np.zeros((2048, 2048), np.float32))   # kept: its pages are not reused below
    if not huge_pages.collapse(probe):
        pytest.skip("this kernel cannot move buffers onto huge pages (MADV_COLLAPSE: Linux 6.1+)")
    weight = np.random.default_rng(0).standard_normal((2048, 2048)).astype(np.float32)   # 16 MB
    buffer = Placement(backend).put_parts(lambda rank: weight, streamed=True)
    address = buffer.unsafe_buffer_pointer()
    assert huge_kb_in(address, address + buffer.nbytes) >= 8 * 1024   # most of its 16 MB
    np.testing.assert_array_equal(np.asarray(buffer), weight)


def test_small_buffers_are_left_alone():
    buffer = get_backend().to_device(np.ones(1000, np.float32))
    assert not huge_pages.collapse(buffer)
