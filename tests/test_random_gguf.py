"""Random checkpoints as GGUF files (tools/random_gguf.py): the same weights as the safetensors
checkpoint they come from, laid out as llama.cpp's converter lays out a Llama."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open

from decoders import LlamaForSampling
from decoders.checkpoints.gguf import GGUFCheckpoint
from tools.random_checkpoint import random_checkpoint
from tools.random_gguf import random_gguf


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("random-models")


def _weights(hf_dir):
    with safe_open(hf_dir / "model.safetensors", framework="pt") as f:
        return {name: f.get_tensor(name).float().numpy() for name in f.keys()}


@pytest.mark.parametrize("gguf_type", ["bf16", "q8_0", "q4_0"])
def test_each_tensor_is_the_checkpoints_as_the_type_stores_it(cache, gguf_type):
    weights = _weights(random_checkpoint("tiny-smollm2", cache))
    checkpoint = GGUFCheckpoint(random_gguf("tiny-smollm2", gguf_type, cache))
    assert set(checkpoint.names()) == set(weights)
    kind = gguf.GGMLQuantizationType[gguf_type.upper()]
    for name, expected in weights.items():
        if expected.ndim == 2 and gguf_type != "bf16":  # bf16 holds the bf16 checkpoint exactly
            stored = gguf.quants.quantize(expected, kind)
            expected = gguf.quants.dequantize(stored, kind).reshape(expected.shape)
        np.testing.assert_array_equal(checkpoint.get(name), expected, err_msg=name)
    assert checkpoint.config["num_hidden_layers"] == 2 and checkpoint.config["vocab_size"] == 512


def test_a_model_from_the_bf16_file_gives_the_tokens_of_the_checkpoint(cache):
    prompts = [[5, 17, 42, 8], [300, 2, 9, 77]]
    tokens = []
    for path in (random_checkpoint("tiny-smollm2", cache), random_gguf("tiny-smollm2", "bf16", cache)):
        model = LlamaForSampling.from_pretrained(path, batch_size=2, n_positions=64, amp="f32",
                                                 context_length_estimate=[16]).to_neuron()
        tokens.append(model.sample(torch.tensor(prompts), sequence_length=24, top_k=1, eos_token_id=[]))
    assert torch.equal(tokens[0], tokens[1])


def test_unknown_types_and_shapes_are_named(cache):
    with pytest.raises(ValueError, match="unknown GGUF type 'q3_x'; choose from bf16, q8_0, q4_0, q4_k_m"):
        random_gguf("tiny-smollm2", "q3_x", cache)
    with pytest.raises(ValueError, match=r"llama3 rope scaling, .* choose a shape with plain rope"):
        random_gguf("tiny", "bf16", cache)
    with pytest.raises(ValueError, match="unknown random model 'huge'"):
        random_gguf("huge", "bf16", cache)
