"""Weights placed straight from a file's mapping: a tensor that lies at a 64-byte boundary of a
safetensors file is the device buffer itself on XLA:CPU (no host copy), and everything read
or placed so equals the file's bytes; a model loaded so computes what it computes from the
same file parsed and copied."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from decoders.checkpoints.hf import _SafetensorsShard
from decoders.checkpoints.streamed_safetensors import write_streamed
from runtime.host_memory import ALIGNMENT, MappedFile, aligned_concatenate, aligned_empty, is_aligned


@pytest.mark.parametrize("shape, dtype", [((3, 5), np.float32), ((7,), ml_dtypes.bfloat16),
                                          ((2, 3, 4), np.int8)])
def test_aligned_arrays_start_at_the_boundary(shape, dtype):
    array = aligned_empty(shape, dtype)
    assert array.shape == shape and array.dtype == np.dtype(dtype) and array.flags.c_contiguous
    assert array.ctypes.data % ALIGNMENT == 0
    parts = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones((1, 3), np.float32)]
    joined = aligned_concatenate(parts)
    assert is_aligned(joined)
    np.testing.assert_array_equal(joined, np.concatenate(parts))


def _tensors(rng):
    """Tensors of whole 64-byte multiples, as a model's are, and a block weight's parts."""
    return {"q:values": rng.integers(0, 255, (4, 32), dtype=np.uint8),
            "q:scales": rng.standard_normal((4, 8)).astype(np.float16),
            "k:values": rng.integers(0, 255, (2, 32), dtype=np.uint8),
            "k:scales": rng.standard_normal((2, 16)).astype(np.float16),
            "norm": rng.standard_normal(16).astype(np.float32),
            "embed": rng.standard_normal((3, 32)).astype(ml_dtypes.bfloat16)}


def test_a_streamed_file_puts_every_tensor_at_a_64_byte_boundary_in_its_group(tmp_path):
    tensors = _tensors(np.random.default_rng(0))
    path = tmp_path / "blocks.safetensors"
    write_streamed(path, tensors.items(), metadata={"forms": "{}"},
                   group=lambda name: 1 if name.endswith(":scales") else 0)
    stored = _SafetensorsShard(path)
    starts = {name: stored._data_start + entry["data_offsets"][0] for name, entry in stored._entries.items()}
    assert all(start % ALIGNMENT == 0 for start in starts.values()), starts
    # Values first, in the order given, then the scales: q's and k's values lie one after another.
    assert sorted(starts, key=starts.get) == ["q:values", "k:values", "norm", "embed", "q:scales", "k:scales"]
    back = load_file(str(path))                    # still a file the safetensors package reads
    for name, array in tensors.items():
        np.testing.assert_array_equal(back[name], array)


def test_tensors_read_from_a_mapping_equal_the_files_bytes(tmp_path):
    tensors = _tensors(np.random.default_rng(1))
    path = tmp_path / "x.safetensors"
    write_streamed(path, tensors.items(), group=lambda name: 1 if name.endswith(":scales") else 0)
    stored = _SafetensorsShard(path)
    for name, array in tensors.items():
        got = stored.read(name)
        assert not got.flags.writeable and not got.flags.owndata and is_aligned(got)   # the mapping itself
        np.testing.assert_array_equal(got, array)
    # Parts lying one after another: one view of them, as if concatenated.
    fused = stored.read_rows(["q:values", "k:values"])
    assert not fused.flags.owndata
    np.testing.assert_array_equal(fused, np.concatenate([tensors["q:values"], tensors["k:values"]]))
    # Parts in another order: one aligned copy.
    joined = stored.read_rows(["k:values", "q:values"])
    assert joined.flags.writeable and is_aligned(joined)
    np.testing.assert_array_equal(joined, np.concatenate([tensors["k:values"], tensors["q:values"]]))
    assert stored.read_rows(["q:values", "norm"]) is None            # shapes that do not join
    assert stored.read_rows(["q:scales", "k:scales"]) is None        # trailing dims differ
    stored.release_pages()
    np.testing.assert_array_equal(stored.read("norm"), tensors["norm"])   # read again after release


def test_a_file_whose_tensors_are_not_aligned_is_read_into_aligned_arrays(tmp_path):
    tensors = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.arange(5, dtype=np.int8),
               "c": np.ones((2, 4), np.float32)}
    path = tmp_path / "hf.safetensors"
    save_file(tensors, str(path))                  # as the safetensors package lays it out
    stored = _SafetensorsShard(path)
    for name, array in tensors.items():
        got = stored.read(name)
        assert is_aligned(got)
        np.testing.assert_array_equal(got, array)
    np.testing.assert_array_equal(stored.read_rows(["a", "c"]), np.concatenate([tensors["a"], tensors["c"]]))


def test_releasing_pages_keeps_every_view_readable(tmp_path):
    data = np.random.default_rng(2).integers(0, 255, 5 * 4096 + 64, dtype=np.uint8)
    path = tmp_path / "raw"
    data.tofile(path)
    mapped = MappedFile(path)
    kept = mapped.view(64, (4096,), np.uint8)
    copied = mapped.view(4096 + 64, (4 * 4096,), np.uint8)
    mapped.release_copied(kept={kept.ctypes.data})
    np.testing.assert_array_equal(kept, data[64:4096 + 64])
    np.testing.assert_array_equal(copied, data[4096 + 64:])       # its pages come back from the page cache
    mapped.close()
    np.testing.assert_array_equal(kept, data[64:4096 + 64])      # the view keeps the mapping alive


@pytest.mark.cpu_only
def test_a_weight_placed_from_a_mapping_is_the_files_memory(tmp_path):
    from runtime import get_backend
    from runtime.placement import Placement

    tensors = _tensors(np.random.default_rng(3))
    path = tmp_path / "x.safetensors"
    write_streamed(path, tensors.items())
    stored = _SafetensorsShard(path)
    placement = Placement(get_backend())
    view = stored.read("embed")
    buffer = placement.put(view)
    assert placement.host_addresses(buffer) == {view.ctypes.data}        # no copy on the host
    np.testing.assert_array_equal(placement.host(buffer), tensors["embed"])
    unaligned = np.frombuffer(view.tobytes() + b"\0", np.uint8)[1:]     # XLA copies this one
    assert not is_aligned(unaligned)
    assert placement.host_addresses(placement.put(unaligned)) != {unaligned.ctypes.data}


def _mapped_files() -> list[tuple[int, int, str]]:
    """This process's file mappings: (start, end, path) from /proc/self/maps."""
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5].startswith("/"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                found.append((start, end, fields[5]))
    return found


@pytest.mark.cpu_only
@pytest.mark.parametrize("amp, gguf_blocks", [("f32", True), ("bf16", False)])
def test_a_converted_gguf_places_its_weights_from_the_file_and_computes_the_same(
        tiny_llama, tmp_path, monkeypatch, amp, gguf_blocks):
    import gguf
    from test_families_mistral_qwen2_mixtral import write_gguf

    from decoders import LlamaForSampling, NeuronConfig

    model, _ = tiny_llama("gqa_tied_llama3", "safetensors")
    state = {name: tensor.float().numpy() for name, tensor in model.state_dict().items()}
    kind = gguf.GGMLQuantizationType.Q8_0 if gguf_blocks else gguf.GGMLQuantizationType.BF16
    path = write_gguf(tmp_path / "tiny.gguf", model, state, "llama", weights_type=kind)

    def build(cache: str):
        monkeypatch.setenv("PYHLO_GGUF_CACHE", cache)
        return LlamaForSampling.from_pretrained(
            path, batch_size=1, n_positions=64, amp=amp, context_length_estimate=[16],
            neuron_config=NeuronConfig(gguf_blocks=gguf_blocks)).to_neuron()

    # From the converted folder's mapping; from the GGUF file parsed and copied.
    mapped, parsed = build(str(tmp_path / "converted")), build("0")
    session = mapped.session
    in_files = [(start, end) for start, end, name in _mapped_files() if "converted" in name]
    # Every matrix is placed as the file holds it (the f32 norms of a bf16 model are converted).
    weights = [value for layer in session.layers for name, value in layer.items() if "norm" not in name]
    from_file = [value for value in weights
                 if any(start <= a < end for a in session.placement.host_addresses(value)
                        for start, end in in_files)]
    assert len(weights) >= 8 and len(from_file) == len(weights), (len(from_file), len(weights))

    prompt = np.arange(3, 20)[None]
    tokens, logits = mapped.sample(prompt, sequence_length=30, top_k=1, eos_token_id=[], output_scores=True)
    expected, expected_logits = parsed.sample(prompt, sequence_length=30, top_k=1, eos_token_id=[],
                                              output_scores=True)
    np.testing.assert_array_equal(tokens, expected)
    for ours, theirs in zip(logits, expected_logits):
        np.testing.assert_array_equal(ours, theirs)
