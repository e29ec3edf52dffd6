"""The user-facing API: errors that name the problem, save/load, configuration."""
from __future__ import annotations

import pytest
import torch

from decoders import GenerationConfig, LlamaForSampling, NeuronConfig, NotSupportedYet


@pytest.fixture(scope="module")
def checkpoint(tiny_llama):
    return tiny_llama("mha", "safetensors")[1]


@pytest.fixture(scope="module")
def model(checkpoint):
    return LlamaForSampling.from_pretrained(checkpoint, batch_size=1, n_positions=128,
                                            context_length_estimate=[16]).to_neuron()


@pytest.mark.parametrize("kwargs, message", [
    (dict(input_ids=torch.tensor([[1, 2, 3]]), sequence_length=129), "exceeds n_positions 128"),
    (dict(input_ids=torch.tensor([[1, 2], [3, 4]]), sequence_length=10), "batch_size=1"),
    (dict(input_ids=torch.tensor([[1.0, 2.0]]), sequence_length=10), "integer token ids"),
    (dict(input_ids=torch.tensor([[1, 2]]), sequence_length=10, top_k=0), "top_k must be an int >= 1"),
    (dict(input_ids=torch.tensor([[1, 2]]), sequence_length=10, top_k=5, top_p=0.0), "top_p must be in (0, 1]"),
    (dict(input_ids=torch.tensor([[1, 2]]), sequence_length=10, top_k=5, top_p=1.5), "top_p must be in (0, 1]"),
    (dict(input_ids=torch.zeros((1, 0), dtype=torch.long), sequence_length=10), "empty"),
    (dict(input_ids=[[]], sequence_length=10), "empty"),
    (dict(input_ids=torch.tensor([[1, 2000]]), sequence_length=10), "outside the vocabulary"),
    (dict(input_ids=torch.tensor([[1, 2, 3]]), sequence_length=2), "exceeds sequence_length 2"),
    (dict(input_ids=torch.tensor([[1, 2]]), sequence_length=10, temperature=0.0), "temperature must be > 0"),
])
def test_bad_input_is_a_clear_value_error(model, kwargs, message):
    with pytest.raises(ValueError) as error:
        model.sample(**kwargs)
    assert message in str(error.value)


def test_unknown_amp_is_rejected(checkpoint):
    with pytest.raises(ValueError, match="unknown amp 'f8'"):
        LlamaForSampling.from_pretrained(checkpoint, amp="f8")


def test_options_not_built_yet_say_so(checkpoint):
    with pytest.raises(NotSupportedYet, match="tp_degree=2"):
        LlamaForSampling.from_pretrained(checkpoint, tp_degree=2)
    with pytest.raises(NotSupportedYet, match="quant"):
        NeuronConfig(quant="int8")
    with pytest.raises(NotSupportedYet, match="attention_layout"):
        NeuronConfig(attention_layout="HSB")
    with pytest.raises(ValueError, match="top_p"):
        GenerationConfig(top_p=0)


def test_sample_before_to_neuron_says_what_to_do(checkpoint):
    model = LlamaForSampling.from_pretrained(checkpoint, n_positions=128, context_length_estimate=[16])
    with pytest.raises(RuntimeError, match="to_neuron"):
        model.sample(torch.tensor([[1, 2]]), sequence_length=5)


def test_save_then_load_compiles_nothing_and_gives_identical_tokens(model, checkpoint, tmp_path, monkeypatch):
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    expected = model.sample(prompt, sequence_length=40, top_k=1, eos_token_id=[])
    model.save(tmp_path)
    monkeypatch.setenv("PYHLO_CACHE", "0")          # no compile cache: only the saved programs
    loaded = LlamaForSampling.from_pretrained(checkpoint, batch_size=1, n_positions=128,
                                              context_length_estimate=[16]).load(tmp_path).to_neuron()
    assert loaded.programs.compiler_calls == 0
    assert loaded.programs.loaded_from_save == len(loaded.eager_programs())
    assert torch.equal(loaded.sample(prompt, sequence_length=40, top_k=1, eos_token_id=[]), expected)


def test_load_refuses_a_directory_saved_for_another_shape(model, checkpoint, tmp_path):
    model.save(tmp_path)
    other = LlamaForSampling.from_pretrained(checkpoint, batch_size=2, n_positions=128,
                                             context_length_estimate=[16])
    with pytest.raises(ValueError, match="batch_size"):
        other.load(tmp_path)


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no such file or directory"):
        LlamaForSampling.from_pretrained(tmp_path / "nope")


def test_a_family_feature_the_block_lacks_is_refused(checkpoint):
    import dataclasses

    from decoders.llama import LLAMA

    class LayerNormLlama(LlamaForSampling):
        family = dataclasses.replace(LLAMA, name="layernorm-llama", norm="layer")

    with pytest.raises(NotSupportedYet, match="norm='layer' is not built yet"):
        LayerNormLlama.from_pretrained(checkpoint, n_positions=128)
