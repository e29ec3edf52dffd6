"""transformers-neuronx's developer guide examples, as its users write them.

- from_pretrained(path) with no n_positions: transformers-neuronx's 2048, or, for a checkpoint
  whose learned position table holds fewer (GPT-2, OPT), as many as the table holds; asking
  for more than the table stays an error.
- NeuronConfig(on_device_embedding=True): the embedding is in the device program already.
- GenerationConfig(max_length=...) in on_device_generation (dynamic, per_batch_line): sample()
  stops each line at max_length tokens (padded prompt and new tokens), or at sequence_length
  where that is smaller.
"""
from __future__ import annotations

import logging

import pytest
import torch
from test_llama_golden import hf_greedy
from test_ragged_batches import left_padded

from decoders import (
    GenerationConfig,
    GPT2ForSampling,
    LlamaForSampling,
    NeuronConfig,
    NotSupportedYet,
    OPTForSampling,
)

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]


# -- n_positions: the default follows the checkpoint's learned position table -------------------

@pytest.mark.parametrize("variant, cls", [("gpt2", GPT2ForSampling), ("opt", OPTForSampling)])
def test_no_n_positions_takes_what_the_learned_position_table_holds(family_checkpoint, caplog, variant, cls):
    _, path = family_checkpoint(variant)                 # a table of 512 positions (OPT: 514 rows, offset 2)
    with caplog.at_level(logging.INFO, logger="pyhlo"):
        model = cls.from_pretrained(path, batch_size=1)
    assert model.n_positions == 512
    assert model.token_buckets == [128, 256, 512]
    said = [r.getMessage() for r in caplog.records]
    assert any("n_positions 512" in m and "position table" in m for m in said), said
    with pytest.raises(ValueError, match="n_positions 1024 exceeds the 512 positions"):
        cls.from_pretrained(path, batch_size=1, n_positions=1024)     # asked for: still an error
    assert cls.from_pretrained(path, n_positions=256).n_positions == 256


def test_no_n_positions_without_a_position_table_is_transformers_neuronx_default(tiny_llama):
    _, path = tiny_llama("mha", "safetensors")           # rotary positions: no table bounds them
    assert LlamaForSampling.from_pretrained(path).n_positions == 2048


def test_gpt2_with_no_n_positions_generates_hf_greedy_tokens(family_checkpoint):
    hf, path = family_checkpoint("gpt2")
    model = GPT2ForSampling.from_pretrained(path, batch_size=1, context_length_estimate=[16]).to_neuron()
    prompt = torch.randint(0, 320, (1, 12), generator=torch.Generator().manual_seed(3))
    expected, _ = hf_greedy(hf, prompt, 40)
    assert torch.equal(model.sample(prompt, sequence_length=40, top_k=1, eos_token_id=[]), expected)


# -- on_device_embedding --------------------------------------------------------------------------

def test_on_device_embedding_true_is_what_pyhlo_builds_and_false_is_refused_by_name():
    assert NeuronConfig(on_device_embedding=True).on_device_embedding is True
    assert NeuronConfig.from_dict(NeuronConfig(on_device_embedding=True).to_dict()).on_device_embedding
    with pytest.raises(NotSupportedYet, match="on_device_embedding=False is not supported yet; "
                                              "the programs take token ids"):
        NeuronConfig(on_device_embedding=False)
    with pytest.raises(ValueError, match="on_device_embedding must be True or False"):
        NeuronConfig(on_device_embedding="yes")


# -- GenerationConfig.max_length ------------------------------------------------------------------

def build(path, generation=None, batch_size=2):
    config = NeuronConfig(on_device_generation=generation, on_device_embedding=True) if generation else None
    return LlamaForSampling.from_pretrained(path, batch_size=batch_size, n_positions=128,
                                            context_length_estimate=[16], neuron_config=config).to_neuron()


@pytest.fixture(scope="module")
def path(tiny_llama):
    return tiny_llama("mha", "safetensors")[1]


@pytest.fixture(scope="module")
def plain(path):
    return build(path)


@pytest.mark.parametrize("settings", [
    dict(max_length=24, do_sample=True, top_k=1),
    dict(max_length=24, dynamic=True, do_sample=True, top_k=50, top_p=0.9, temperature=0.9),
    dict(max_length=24, dynamic=True, per_batch_line=True, do_sample=True, top_k=[1, 50], top_p=[1.0, 0.9],
         temperature=[1.0, 0.9]),
], ids=["greedy", "dynamic", "per_batch_line"])
def test_sample_stops_at_max_length_as_with_that_sequence_length(path, plain, settings):
    model = build(path, GenerationConfig(**settings))
    out = model.sample(PROMPTS, sequence_length=1000, seed=0, eos_token_id=[])   # past n_positions: fine
    assert out.shape == (2, 24)                                   # the longer prompt (8) + 16 new tokens
    assert torch.equal(out, model.sample(PROMPTS, sequence_length=24, seed=0, eos_token_id=[]))
    same = dict(seed=0, eos_token_id=[], top_k=settings["top_k"], top_p=settings.get("top_p", 1.0),
                temperature=settings.get("temperature", 1.0))
    assert torch.equal(out, plain.sample(PROMPTS, sequence_length=24, **same))
    shorter = model.sample(PROMPTS, sequence_length=20, seed=0, eos_token_id=[])   # the smaller of both
    assert shorter.shape == (2, 20)
    assert torch.equal(shorter, plain.sample(PROMPTS, sequence_length=20, **same))


def test_max_length_counts_the_padded_prompt_width_as_hf_does(path, plain):
    model = build(path, GenerationConfig(max_length=30, do_sample=True, top_k=1))
    ids, mask = left_padded(lengths=(5, 11))                      # width 11, as HF counts it
    out = model.sample(ids, sequence_length=64, attention_mask=mask, eos_token_id=[])
    assert out.shape == (2, 30)
    expected = plain.sample(ids, sequence_length=30, attention_mask=mask, top_k=1, eos_token_id=[])
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="prompt length 11 exceeds GenerationConfig.max_length 8"):
        build(path, GenerationConfig(max_length=8, do_sample=True, top_k=1)).sample(
            ids, sequence_length=64, attention_mask=mask)


def test_update_generation_config_changes_max_length(path):
    model = build(path, GenerationConfig(max_length=24, do_sample=True, top_k=1))
    model.update_generation_config(GenerationConfig(max_length=16, do_sample=True, top_k=1))
    assert model.sample(PROMPTS, sequence_length=100, eos_token_id=[]).shape == (2, 16)
    model.update_generation_config(GenerationConfig(do_sample=True, top_k=1))     # None: sequence_length only
    assert model.sample(PROMPTS, sequence_length=40, eos_token_id=[]).shape == (2, 40)
    with pytest.raises(ValueError, match="max_length must be None or an int >= 1"):
        GenerationConfig(max_length=0)
