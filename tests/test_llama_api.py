"""The user-facing API: errors that name the problem, save/load, configuration."""
from __future__ import annotations

import pytest
import torch

from decoders import GQA, GenerationConfig, LlamaForSampling, NeuronConfig, NotSupportedYet


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
    (dict(input_ids=torch.tensor([[1, 2]]), sequence_length=10, top_k=5, top_p=0.0),
     "top_p must be in (0, 1]"),
    (dict(input_ids=torch.tensor([[1, 2]]), sequence_length=10, top_k=5, top_p=1.5),
     "top_p must be in (0, 1]"),
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


def test_tp_degree_beyond_the_devices_says_how_to_get_them(checkpoint):
    from runtime import get_backend

    backend = get_backend()
    if backend.device_count > 1:
        pytest.skip(f"{backend.device_count} {backend.platform} devices here")
    how = ".*device_count=2 .*--tp-degree" if backend.platform == "cpu" else ""
    with pytest.raises(ValueError, match=rf"tp_degree=2 \(--tp-degree 2\) needs 2 devices; the "
                                         rf"{backend.platform} backend has 1: pass a tp_degree of at most "
                                         rf"1{how}"):
        LlamaForSampling.from_pretrained(checkpoint, tp_degree=2)


def test_tp_degree_that_reaches_no_device_of_this_process_says_what_to_pass():
    from runtime.placement import Placement

    class SecondOfTwoProcesses:            # two processes of two devices each; this one holds 2 and 3
        platform, device_count, process_count, process_index = "cpu", 4, 2, 1

        def local_replicas(self, replicas: int) -> list[int]:
            return [r for r in range(replicas) if r >= 2]

    assert Placement(SecondOfTwoProcesses(), 4).local == [2, 3]
    with pytest.raises(ValueError, match=r"tp_degree=2 \(--tp-degree 2\) runs on the first 2 of the 4 "
                                         r"devices of 2 processes, none of them in this process \(1\): "
                                         r".*tp_degree=4"):
        Placement(SecondOfTwoProcesses(), 2)


def test_options_not_built_yet_say_so(checkpoint):
    with pytest.raises(ValueError, match="NeuronConfig.quant must be None or a QuantizationConfig"):
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


def test_a_config_feature_the_pieces_lack_is_refused(checkpoint, tmp_path):
    import json
    import shutil

    copy = tmp_path / "yarn"
    shutil.copytree(checkpoint, copy)
    config = json.loads((copy / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0}
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotSupportedYet, match="rope_scaling type 'yarn' is not supported yet"):
        LlamaForSampling.from_pretrained(copy, n_positions=128)


def test_every_neuron_config_option_is_built_or_refused():
    # built: flash decoding, transformers-neuronx's GQA names or string values (refused per model
    # and tp_degree where they do not fit; tests/test_gqa_strategies.py)
    assert NeuronConfig(shard_over_sequence=True).shard_over_sequence
    assert (NeuronConfig(group_query_attention="shard-over-heads").group_query_attention
            is GQA.SHARD_OVER_HEADS)
    assert NeuronConfig(group_query_attention=GQA.REPLICATED_HEADS).to_dict()["group_query_attention"] == \
        "replicated-heads"
    with pytest.raises(ValueError, match="group_query_attention must be None or one of"):
        NeuronConfig(group_query_attention="shard-over-everything")
    with pytest.raises(NotSupportedYet, match="padding_side='left'"):
        NeuronConfig(padding_side="left")
    with pytest.raises(NotSupportedYet, match="deterministic"):
        NeuronConfig(on_device_generation=GenerationConfig(deterministic=True))
    assert NeuronConfig(on_device_generation=GenerationConfig(max_length=64))   # built: sample() stops there
    assert NeuronConfig(on_device_embedding=True).on_device_embedding        # built: embedding on the device
    with pytest.raises(NotSupportedYet, match="on_device_embedding=False"):
        NeuronConfig(on_device_embedding=False)
    with pytest.raises(NotSupportedYet, match="dynamic=False"):
        NeuronConfig(on_device_generation=GenerationConfig(dynamic=False))
    assert NeuronConfig(fuse_qkv=False).fuse_qkv is False       # built: three q, k, v weights
    assert NeuronConfig(on_device_generation=GenerationConfig(per_batch_line=True, top_k=[1, 5]))  # built


def test_fuse_qkv_false_gives_the_same_tokens_with_three_weights(model, checkpoint):
    split = LlamaForSampling.from_pretrained(checkpoint, n_positions=128, context_length_estimate=[16],
                                             neuron_config=NeuronConfig(fuse_qkv=False)).to_neuron()
    names = split.programs.build(split.eager_programs()[-2]).param_names
    assert ({"attn.q.weight", "attn.k.weight", "attn.v.weight"} <= set(names)
            and "attn.qkv.weight" not in names)
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    assert torch.equal(split.sample(prompt, sequence_length=30, top_k=1, eos_token_id=[]),
                       model.sample(prompt, sequence_length=30, top_k=1, eos_token_id=[]))


def test_on_device_generation_config_sets_the_sampling_defaults(checkpoint):
    greedy = GenerationConfig(do_sample=False)
    model = LlamaForSampling.from_pretrained(checkpoint, n_positions=128, context_length_estimate=[16],
                                             neuron_config=NeuronConfig(on_device_generation=greedy)).to_neuron()
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    # do_sample=False: greedy whatever the seed, as top_k=1 is
    assert torch.equal(model.sample(prompt, sequence_length=30, seed=1, eos_token_id=[]),
                       model.sample(prompt, sequence_length=30, top_k=1, seed=2, eos_token_id=[]))
