"""A GGUF file is converted once into memory-mapped safetensors; later opens read those."""
from __future__ import annotations

import numpy as np

from decoders.checkpoints import open_checkpoint
from decoders.checkpoints.gguf import GGUFCheckpoint
from decoders.checkpoints.gguf_cache import ConvertedGGUF


def test_second_open_reads_the_converted_copy_with_identical_tensors(smollm2_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("PYHLO_GGUF_CACHE", str(tmp_path))
    first = open_checkpoint(smollm2_gguf)
    assert isinstance(first, GGUFCheckpoint)
    second = open_checkpoint(smollm2_gguf)
    assert isinstance(second, ConvertedGGUF)
    # Each tensor once: the Q4_1 weights as their blocks, not also widened to f32.
    assert sum(f.stat().st_size for f in second.path.iterdir()) < 1.1 * smollm2_gguf.stat().st_size
    assert second.config == first.config
    assert sorted(second.names()) == sorted(first.names())
    for name in ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.29.mlp.down_proj.weight", "model.norm.weight"]:
        np.testing.assert_array_equal(second.get(name), first.get(name))
    assert second.chat_template() == first.chat_template()
    assert second.tokenizer()("Hello, world")["input_ids"] == first.tokenizer()("Hello, world")["input_ids"]


def test_conversion_can_be_turned_off(smollm2_gguf, monkeypatch):
    monkeypatch.setenv("PYHLO_GGUF_CACHE", "0")
    assert isinstance(open_checkpoint(smollm2_gguf), GGUFCheckpoint)
