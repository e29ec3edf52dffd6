"""On-device generation settings (NeuronConfig(on_device_generation=GenerationConfig(...))):
changed between sample() calls without compiling, per batch line, bounded by global_top_k;
no_repeat_ngram_size as HF applies it; HF streamers and stopping criteria in sample()."""
from __future__ import annotations

import threading

import pytest
import torch
from tiny_tokenizer import make_tokenizer
from transformers import MaxLengthCriteria, StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer

from decoders import GenerationConfig, LlamaForSampling, NeuronConfig, NotSupportedYet

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]
LENGTH = 40


def build(path, batch_size=2, generation=None):
    neuron_config = NeuronConfig(on_device_generation=generation) if generation else None
    return LlamaForSampling.from_pretrained(path, batch_size=batch_size, n_positions=128,
                                            context_length_estimate=[16],
                                            neuron_config=neuron_config).to_neuron()


@pytest.fixture(scope="module")
def path(tiny_llama):
    return tiny_llama("mha", "safetensors")[1]


@pytest.fixture(scope="module")
def greedy(path):
    """Greedy tokens of PROMPTS, from a model without on-device settings."""
    return build(path).sample(PROMPTS, sequence_length=LENGTH, top_k=1, eos_token_id=[])


def test_update_generation_config_changes_sampling_without_compiling(path, greedy):
    model = build(path, generation=GenerationConfig(do_sample=True, top_k=1))
    assert torch.equal(model.sample(PROMPTS, sequence_length=LENGTH, seed=0, eos_token_id=[]), greedy)
    compiler_calls, programs = model.programs.compiler_calls, set(model.programs.compiled)

    model.update_generation_config(GenerationConfig(do_sample=True, top_k=50, temperature=1.5))
    first = model.sample(PROMPTS, sequence_length=LENGTH, seed=0, eos_token_id=[])
    assert not torch.equal(first, greedy)
    assert torch.equal(model.sample(PROMPTS, sequence_length=LENGTH, seed=0, eos_token_id=[]), first)

    model.update_generation_config(GenerationConfig(do_sample=True, top_k=3, temperature=2.0))
    tokens, scores = model.sample(PROMPTS, sequence_length=LENGTH, seed=1, eos_token_id=[],
                                  output_scores=True)
    for step, logits in enumerate(scores):
        allowed = logits.topk(3, dim=-1).indices.tolist()
        assert all(int(tokens[i, len(p) + step]) in allowed[i] for i, p in enumerate(PROMPTS)), step

    model.update_generation_config(GenerationConfig(do_sample=True, top_k=50, top_p=1e-6))   # nucleus of one
    assert torch.equal(model.sample(PROMPTS, sequence_length=LENGTH, seed=2, eos_token_id=[]), greedy)
    model.update_generation_config(GenerationConfig(do_sample=False, top_k=50, temperature=1.5))
    assert torch.equal(model.sample(PROMPTS, sequence_length=LENGTH, seed=3, eos_token_id=[]), greedy)

    assert model.programs.compiler_calls == compiler_calls
    assert set(model.programs.compiled) == programs        # nothing built, not even from the compile cache


def first_new_at_or_after(tokens, start):
    """(index, token): the first of `tokens` from `start` on that does not occur before it."""
    return next((k, t) for k, t in enumerate(tokens) if k >= start and t not in tokens[:k])


def test_eos_token_id_is_a_setting_too(path, greedy):
    model = build(path, generation=GenerationConfig(do_sample=False, eos_token_id=[]))
    new0 = greedy[0, len(PROMPTS[0]):].tolist()
    k, eos = first_new_at_or_after(new0, 5)
    model.update_generation_config(GenerationConfig(do_sample=False, eos_token_id=eos))
    out = model.sample(PROMPTS, sequence_length=LENGTH)
    end = len(PROMPTS[0]) + k + 1                          # line 0 ends with its EOS ...
    assert out[0, :end].tolist() == greedy[0, :end].tolist()
    assert (out[0, end:] == eos).all()                     # ... and is padded with it


def test_per_batch_line_top_k_makes_line_0_greedy_while_line_1_samples(path, greedy):
    config = GenerationConfig(do_sample=True, per_batch_line=True, top_k=[1, 20], temperature=[1.0, 1.5],
                              global_top_k=32)
    model = build(path, generation=config)
    runs = [model.sample(PROMPTS, sequence_length=LENGTH, seed=seed, eos_token_id=[]) for seed in (0, 1)]
    for out in runs:
        assert torch.equal(out[0], greedy[0])
        assert not torch.equal(out[1], greedy[1])
    assert not torch.equal(runs[0][1], runs[1][1])
    compiler_calls, programs = model.programs.compiler_calls, set(model.programs.compiled)
    # a single value serves every line; a top_k above global_top_k is refused
    model.update_generation_config(GenerationConfig(do_sample=True, per_batch_line=True, top_k=[20, 1],
                                                    temperature=1.5))
    out = model.sample(PROMPTS, sequence_length=LENGTH, seed=0, eos_token_id=[])
    assert torch.equal(out[1], greedy[1]) and not torch.equal(out[0], greedy[0])
    model.update_generation_config(GenerationConfig(do_sample=True, per_batch_line=True, top_k=1))
    assert torch.equal(model.sample(PROMPTS, sequence_length=LENGTH, seed=0, eos_token_id=[]), greedy)
    assert model.programs.compiler_calls == compiler_calls and set(model.programs.compiled) == programs
    with pytest.raises(ValueError, match="top_k 40 exceeds global_top_k 32"):
        model.update_generation_config(GenerationConfig(do_sample=True, per_batch_line=True, top_k=[1, 40]))
    with pytest.raises(ValueError, match="top_k 40 exceeds global_top_k 32"):
        model.sample(PROMPTS, sequence_length=LENGTH, top_k=40)
    with pytest.raises(ValueError,
                       match="per_batch_line=False, the model was built with per_batch_line=True"):
        model.update_generation_config(GenerationConfig(do_sample=True, top_k=5))
    with pytest.raises(ValueError, match="global_top_k is fixed"):
        model.update_generation_config(GenerationConfig(do_sample=True, per_batch_line=True, top_k=8,
                                                        global_top_k=16))
    with pytest.raises(ValueError, match="GenerationConfig.top_k has 3 values for 2 batch lines"):
        model.update_generation_config(GenerationConfig(do_sample=True, per_batch_line=True, top_k=[1, 2, 3]))


def test_settings_that_are_not_built_or_do_not_fit_are_clear_errors(path):
    with pytest.raises(ValueError, match="per_batch_line=True"):
        GenerationConfig(top_k=[1, 20])
    with pytest.raises(ValueError, match="top_k 64 exceeds global_top_k 32"):
        GenerationConfig(top_k=64, global_top_k=32)
    with pytest.raises(ValueError, match="top_p must be in"):
        GenerationConfig(per_batch_line=True, top_p=[0.5, 0.0])
    for refused in (dict(dynamic=False), dict(deterministic=True)):
        with pytest.raises(NotSupportedYet, match=next(iter(refused))):
            NeuronConfig(on_device_generation=GenerationConfig(**refused))
    with pytest.raises(ValueError, match="GenerationConfig.top_k has 3 values for 2 batch lines"):
        build(path, generation=GenerationConfig(do_sample=True, per_batch_line=True, top_k=[1, 2, 3]))
    plain = LlamaForSampling.from_pretrained(path, batch_size=2, n_positions=128,
                                             context_length_estimate=[16])
    with pytest.raises(ValueError, match="on_device_generation"):
        plain.update_generation_config(GenerationConfig(top_k=5))


# -- no_repeat_ngram_size, as HF's NoRepeatNGramLogitsProcessor ---------------------------------

def hf_no_repeat(hf, ids, mask, new_tokens, n):
    return hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, no_repeat_ngram_size=n, pad_token_id=0)


def test_no_repeat_ngram_size_3_gives_hf_generate_output(tiny_llama):
    hf, path = tiny_llama("mha", "safetensors")
    model = build(path, batch_size=3)
    gen = torch.Generator().manual_seed(5)
    lengths, width, new_tokens = (9, 3, 14), 14, 60
    ids, mask = torch.zeros((3, width), dtype=torch.long), torch.zeros((3, width), dtype=torch.long)
    for i, n in enumerate(lengths):
        # few distinct ids, so that n-grams repeat in the prompts as well
        ids[i, width - n:] = torch.randint(1, 6, (n,), generator=gen)
        mask[i, width - n:] = 1
    plain = model.sample(ids, sequence_length=width + new_tokens, top_k=1, eos_token_id=[],
                         attention_mask=mask)
    # HF bans over each whole row, its padding included: padding that holds line 1's own greedy
    # continuation bans a token there (the padding is masked, so the logits do not change).
    ids[1, : width - lengths[1]] = plain[1, width: 2 * width - lengths[1]]
    expected = hf_no_repeat(hf, ids, mask, new_tokens, 3)
    out = model.sample(ids, sequence_length=width + new_tokens, top_k=1, eos_token_id=[], attention_mask=mask,
                       no_repeat_ngram_size=3)
    assert torch.equal(out, expected)
    assert not torch.equal(out[:, width:], plain[:, width:])      # the bans changed something
    # prompts of different lengths, no padding: each line as HF generates it alone
    prompts = [ids[i, width - n:].tolist() for i, n in enumerate(lengths)]
    out = model.sample(prompts, sequence_length=width + new_tokens, top_k=1, eos_token_id=[],
                       no_repeat_ngram_size=3)
    for i, prompt in enumerate(prompts):
        alone = hf_no_repeat(hf, torch.tensor([prompt]), None, new_tokens, 3)
        assert out[i, : len(prompt) + new_tokens].tolist() == alone[0].tolist(), i


# -- HF streamers and stopping criteria in sample() ---------------------------------------------

def test_text_iterator_streamer_yields_the_decoded_output(path):
    model = build(path, batch_size=1)
    tokenizer = make_tokenizer()
    prompt = tokenizer("t3 t1 t4 t1 t5 t9 t2 t6", return_tensors="pt")["input_ids"]
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=60)
    result = {}
    worker = threading.Thread(target=lambda: result.update(out=model.sample(
        prompt, sequence_length=40, top_k=20, temperature=1.2, seed=4, eos_token_id=[], streamer=streamer)))
    worker.start()
    pieces = list(streamer)
    worker.join()
    out = result["out"]
    assert out.shape == (1, 40) and len(pieces) > 1
    assert "".join(pieces) == tokenizer.decode(out[0, prompt.shape[1]:])


def test_hf_stopping_criteria_end_sample(path, greedy):
    model = build(path)

    class StopAtToken(StoppingCriteria):
        def __init__(self, token):
            self.token = token

        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == self.token

    # left-padded, so that every line's last token is the last column, as HF criteria expect
    width = len(PROMPTS[0])
    ids = torch.tensor([PROMPTS[0], [0] * (width - len(PROMPTS[1])) + PROMPTS[1]])
    start_ids = torch.tensor([0, width - len(PROMPTS[1])])
    new = [greedy[i, len(p):].tolist() for i, p in enumerate(PROMPTS)]
    k, stop = next((k, t) for k, t in enumerate(new[1])
                   if k >= 3 and t not in new[1][:k] and t not in new[0][:22])
    criteria = StoppingCriteriaList([StopAtToken(stop), MaxLengthCriteria(width + 22)])
    out = model.sample(ids, sequence_length=LENGTH, start_ids=start_ids, top_k=1, eos_token_id=[],
                       stopping_criteria_list=criteria)
    assert out.shape[1] == width + 22                      # line 0 ran until MaxLengthCriteria
    assert out[0, width:].tolist() == new[0][:22]
    assert out[1, width: width + k + 1].tolist() == new[1][: k + 1]     # line 1 stopped at `stop`
