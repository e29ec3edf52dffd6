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


def _mapped(tmp_path, array):
    from runtime.host_memory import MappedFile

    path = tmp_path / "weights"
    array.tofile(path)
    return MappedFile(path).view(0, array.shape, array.dtype)


@pytest.mark.parametrize("dtype", [np.float32, "bfloat16"])
def test_a_float_weight_in_a_files_mapping_is_copied_onto_huge_pages(tmp_path, dtype):
    if not huge_pages.available():
        pytest.skip("this kernel cannot move buffers onto huge pages (MADV_COLLAPSE: Linux 6.1+)")
    import ml_dtypes

    dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    weight = np.random.default_rng(1).standard_normal((1024, 2048)).astype(dtype)   # 4 or 8 MB
    view = _mapped(tmp_path, weight)
    placement = Placement(get_backend())
    buffer = placement.put_parts(lambda rank: view, streamed=True)
    address = buffer.unsafe_buffer_pointer()
    assert address % huge_pages.HUGE_PAGE == 0 and address != view.ctypes.data
    assert huge_kb_in(address, address + buffer.nbytes) >= 2 * 1024
    np.testing.assert_array_equal(np.asarray(buffer), weight)
    # Not streamed (a value read in pieces): it stays the mapping's memory.
    assert placement.host_addresses(placement.put(view)) == {view.ctypes.data}


def test_block_weights_and_small_tensors_stay_in_the_mapping(tmp_path):
    blocks = _mapped(tmp_path, np.random.default_rng(2).integers(0, 255, (2048, 2048), dtype=np.uint8))
    assert huge_pages.off_the_mapping(blocks) is blocks
    small = np.ones((256, 256), np.float32)
    assert huge_pages.off_the_mapping(small) is small            # not a mapping, and under 2 MB
    own = np.ones((1024, 1024), np.float32)
    assert huge_pages.off_the_mapping(own) is own                # memory of its own already
