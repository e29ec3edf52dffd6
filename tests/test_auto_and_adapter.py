"""NeuronAutoModelForCausalLM (the family class by model_type) and HuggingFaceGenerationModelAdapter
(HF's own generate() on the compiled model), against HF transformers' generate() on the same weights."""
from __future__ import annotations

import importlib
import json
import pathlib
import shutil
import threading

import pytest
import torch
from test_ragged_batches import left_padded
from tiny_tokenizer import make_tokenizer
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    StoppingCriteria,
    StoppingCriteriaList,
    TextIteratorStreamer,
    TextStreamer,
)

from decoders import (
    HuggingFaceGenerationModelAdapter,
    LlamaForSampling,
    NeuronAutoModelForCausalLM,
    NotSupportedYet,
)
from decoders.families import CLASSES, sampling_class

TESTS = pathlib.Path(__file__).parent
LENGTHS = (7, 19, 12)      # left_padded()'s


# -- NeuronAutoModelForCausalLM ------------------------------------------------------------------

def tiny_hf_model(model_type: str):
    """A tiny random HF model of `model_type`: the tests' own makers, else HF's defaults made tiny."""
    if model_type == "llama":
        from tiny_llama import make_model

        return make_model("mha")
    for maker in sorted(TESTS.glob("tiny_families*.py")):
        module = importlib.import_module(maker.stem)
        if model_type in getattr(module, "VARIANTS", {}):
            return module.make_model(model_type)
    config = AutoConfig.for_model(model_type, vocab_size=320, hidden_size=64, intermediate_size=160,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                  max_position_embeddings=512)
    return AutoModelForCausalLM.from_config(config)


REGISTERED = {t: cls for cls in reversed(CLASSES) for t in cls.family.model_types}   # the first class wins


@pytest.mark.parametrize("model_type", sorted(REGISTERED))
def test_auto_picks_the_family_of_every_registered_model_type(model_type, tmp_path):
    tiny_hf_model(model_type).save_pretrained(tmp_path, safe_serialization=True)
    model = NeuronAutoModelForCausalLM.from_pretrained(tmp_path, batch_size=2, n_positions=128)
    assert type(model) is REGISTERED[model_type] is sampling_class(model_type)
    assert (model.batch_size, model.n_positions) == (2, 128)        # the arguments reach from_pretrained


def test_auto_reads_a_gguf_file(tmp_path):
    from test_gguf_checkpoint import TINY, write_tiny_gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    state = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=False)).state_dict()
    path = write_tiny_gguf(tmp_path / "tiny.gguf", state)
    assert type(NeuronAutoModelForCausalLM.from_pretrained(path, n_positions=128)) is LlamaForSampling


def test_auto_refuses_an_unknown_model_type_naming_the_supported_ones(tiny_llama, tmp_path):
    copy = tmp_path / "unknown"
    shutil.copytree(tiny_llama("mha", "safetensors")[1], copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "model_type": "not_a_decoder"}))
    with pytest.raises(ValueError,
                       match="'not_a_decoder' is not supported; supported: .*llama.*gpt_neox.*bloom"):
        NeuronAutoModelForCausalLM.from_pretrained(copy)


# -- HuggingFaceGenerationModelAdapter -----------------------------------------------------------

@pytest.fixture(scope="module")
def hf_and_path(tiny_llama):
    return tiny_llama("mha", "safetensors")


@pytest.fixture(scope="module")
def adapter(hf_and_path):
    hf, path = hf_and_path
    model = NeuronAutoModelForCausalLM.from_pretrained(path, batch_size=len(LENGTHS), n_positions=128,
                                                       context_length_estimate=[16, 32]).to_neuron()
    return HuggingFaceGenerationModelAdapter(hf.config, model)


@pytest.fixture(scope="module")
def adapter_1(hf_and_path):
    hf, path = hf_and_path
    model = LlamaForSampling.from_pretrained(path, batch_size=1, n_positions=128,
                                             context_length_estimate=[16]).to_neuron()
    return HuggingFaceGenerationModelAdapter(hf.config, model)


def both(hf, adapter, *args, seed=None, **kwargs):
    """HF's generate() and the adapter's, with the same arguments (and the same torch seed)."""
    outputs = []
    for model in (hf, adapter):
        if seed is not None:
            torch.manual_seed(seed)
        outputs.append(model.generate(*args, **kwargs))
    return outputs


def test_greedy_generate_gives_hf_output_on_a_left_padded_batch(hf_and_path, adapter):
    hf, _ = hf_and_path
    ids, mask = left_padded()
    expected, got = both(hf, adapter, ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                         pad_token_id=0)
    assert got.shape == (3, ids.shape[1] + 30) and torch.equal(got, expected)
    expected, got = both(hf, adapter, ids, attention_mask=mask, max_length=40, do_sample=False,
                         pad_token_id=0)
    assert got.shape == (3, 40) and torch.equal(got, expected)
    # an EOS id that line 0 draws: it stops there and is padded, as in HF
    new0 = expected[0, ids.shape[1]:].tolist()
    eos = next(t for k, t in enumerate(new0) if k >= 3 and t not in new0[:k])
    expected, got = both(hf, adapter, ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                         eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got, expected) and (got[0, ids.shape[1] + new0.index(eos) + 1:] == 0).all()


@pytest.mark.parametrize("model_type", sorted(REGISTERED))
def test_every_family_through_the_adapter_gives_hf_generate_output(model_type, tmp_path):
    hf = tiny_hf_model(model_type)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = NeuronAutoModelForCausalLM.from_pretrained(tmp_path, batch_size=len(LENGTHS), n_positions=128,
                                                       context_length_estimate=[32]).to_neuron()
    ids, mask = left_padded()
    expected, got = both(hf, HuggingFaceGenerationModelAdapter(hf.config, model), ids, attention_mask=mask,
                         max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(got, expected)


def test_sampling_generate_gives_hf_output_with_the_same_seed(hf_and_path, adapter):
    hf, _ = hf_and_path
    ids, mask = left_padded()
    settings = dict(do_sample=True, top_k=20, top_p=0.9, temperature=1.3, max_new_tokens=25, pad_token_id=0)
    expected, got = both(hf, adapter, ids, attention_mask=mask, seed=3, **settings)
    assert torch.equal(got, expected)
    _, other = both(hf, adapter, ids, attention_mask=mask, seed=4, **settings)
    assert not torch.equal(other, got)


def test_num_return_sequences_gives_different_continuations_of_one_prompt(adapter):
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10]])
    torch.manual_seed(0)
    out = adapter.generate(prompt, do_sample=True, top_k=50, temperature=1.5, num_return_sequences=3,
                           max_new_tokens=20, pad_token_id=0)
    assert out.shape == (3, 26) and (out[:, :6] == prompt).all()
    continuations = {tuple(line) for line in out[:, 6:].tolist()}
    assert len(continuations) == 3
    ids, mask = left_padded()
    with pytest.raises(ValueError,
                       match=r"9 batch lines \(3 prompts x num_return_sequences=3\).*batch_size=3"):
        adapter.generate(ids, attention_mask=mask, do_sample=True, num_return_sequences=3, max_new_tokens=5)


def test_each_generate_starts_a_new_sequence_and_reset_generation_forgets(adapter):
    ids, mask = left_padded()
    first = adapter.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert adapter.cur_len > 0
    again = adapter.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(first, again)
    adapter.reset_generation()
    assert adapter.cur_len == 0


def test_hf_stopping_criteria_through_generate(hf_and_path, adapter):
    hf, _ = hf_and_path

    class StopAtToken(StoppingCriteria):
        def __init__(self, token):
            self.token = token

        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == self.token

    ids, mask = left_padded()
    plain = hf.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0)
    stop = int(plain[1, ids.shape[1] + 4])
    criteria = StoppingCriteriaList([StopAtToken(stop)])
    expected, got = both(hf, adapter, ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                         pad_token_id=0, stopping_criteria=criteria)
    assert torch.equal(got, expected)


def test_streamers_through_generate_give_the_decoded_output(adapter_1, capsys):
    tokenizer = make_tokenizer()
    prompt = tokenizer("t3 t1 t4 t1 t5 t9 t2 t6", return_tensors="pt")["input_ids"]
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=60)
    result = {}
    settings = dict(do_sample=True, top_k=20, temperature=1.2, max_new_tokens=30, pad_token_id=0)
    worker = threading.Thread(target=lambda: result.update(out=adapter_1.generate(prompt, streamer=streamer,
                                                                                 **settings)))
    worker.start()
    pieces = list(streamer)
    worker.join()
    out = result["out"]
    assert out.shape == (1, prompt.shape[1] + 30) and len(pieces) > 1
    assert "".join(pieces) == tokenizer.decode(out[0, prompt.shape[1]:])
    capsys.readouterr()
    out = adapter_1.generate(prompt, streamer=TextStreamer(tokenizer, skip_prompt=True), **settings)
    assert capsys.readouterr().out == tokenizer.decode(out[0, prompt.shape[1]:]) + "\n"


def test_what_the_adapter_cannot_run_is_a_clear_error(adapter):
    ids, mask = left_padded()
    right = torch.tensor([[1, 2, 3], [4, 5, 0], [6, 0, 0]])
    with pytest.raises(ValueError, match="left padding"):
        adapter.generate(right, attention_mask=(right > 0).long(), max_new_tokens=5, pad_token_id=0)
    with pytest.raises(NotSupportedYet, match="num_beams=2"):
        adapter.generate(ids, attention_mask=mask, num_beams=2, max_new_tokens=5, pad_token_id=0)
    with pytest.raises(ValueError, match="n_positions=128"):
        adapter.generate(ids, attention_mask=mask, max_new_tokens=200, pad_token_id=0)
    with pytest.raises(ValueError, match="only supports"):            # HF's own check, for what num_beams
                                                                      # misses
        adapter.generate(ids, attention_mask=mask, assistant_model=adapter, max_new_tokens=5, pad_token_id=0)
