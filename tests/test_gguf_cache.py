"""A GGUF file is converted once into memory-mapped safetensors; later opens read those."""
from __future__ import annotations

import numpy as np

from decoders.checkpoints import open_checkpoint
from decoders.checkpoints.gguf import GGUFCheckpoint
from decoders.checkpoints.gguf_cache import ConvertedGGUF


def test_every_open_reads_the_converted_copy_with_the_files_tensors(smollm2_gguf, tmp_path, monkeypatch):
    """The first open converts the file and reads the copy as later opens do (plain reads, not
    the GGUF mapping the conversion went through)."""
    monkeypatch.setenv("PYHLO_GGUF_CACHE", str(tmp_path))
    file = GGUFCheckpoint(smollm2_gguf)
    first, second = open_checkpoint(smollm2_gguf), open_checkpoint(smollm2_gguf)
    assert isinstance(first, ConvertedGGUF) and isinstance(second, ConvertedGGUF)
    assert second.config == file.config
    assert sorted(second.names()) == sorted(file.names())
    # Each tensor once: the Q4_1 weights as their blocks, not also widened to f32.
    assert sum(f.stat().st_size for f in second.path.iterdir()) < 1.1 * smollm2_gguf.stat().st_size
    for name in ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.29.mlp.down_proj.weight", "model.norm.weight"]:
        np.testing.assert_array_equal(second.get(name), file.get(name))
    for name in ["model.layers.0.self_attn.q_proj.weight", "model.layers.29.mlp.down_proj.weight"]:
        assert second.block_form(name) == file.block_form(name)
        for stored, converted in zip(file.blocks(name), second.blocks(name)):
            np.testing.assert_array_equal(converted, stored)
    assert second.chat_template() == file.chat_template()
    assert second.tokenizer()("Hello, world")["input_ids"] == file.tokenizer()("Hello, world")["input_ids"]


def test_conversion_can_be_turned_off(smollm2_gguf, monkeypatch):
    monkeypatch.setenv("PYHLO_GGUF_CACHE", "0")
    assert isinstance(open_checkpoint(smollm2_gguf), GGUFCheckpoint)
