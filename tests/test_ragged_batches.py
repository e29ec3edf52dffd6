"""Ragged batches as transformers-neuronx and HF generate() take them: a left-padded tensor
marked by `start_ids` or `attention_mask`; the padded layout comes back (input as given,
then the new tokens). And forward(), step by step, against HF's logits."""
from __future__ import annotations

import pytest
import torch
from test_llama_golden import relative_error

from decoders import BloomForSampling, GPTNeoXForSampling, LlamaForSampling

LENGTHS = (7, 19, 12)
NEW_TOKENS = 30


@pytest.fixture(scope="module")
def families(tiny_llama, tmp_path_factory):
    from tiny_families import make_model, save

    made = {"llama": (LlamaForSampling, *tiny_llama("gqa_tied_llama3", "safetensors"))}
    for name, cls in (("gpt_neox", GPTNeoXForSampling), ("bloom", BloomForSampling)):
        hf = make_model(name)
        made[name] = (cls, hf, save(hf, tmp_path_factory.mktemp(name)))
    return made


def left_padded(lengths=LENGTHS, seed=11):
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(1, 320, (n,), generator=gen)
        mask[i, width - n:] = 1
    return ids, mask


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "bloom"])
def test_start_ids_and_attention_mask_give_hf_generate_output(families, family):
    cls, hf, path = families[family]
    model = cls.from_pretrained(path, batch_size=len(LENGTHS), n_positions=128,
                                context_length_estimate=[16, 32]).to_neuron()
    ids, mask = left_padded()
    expected = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                           do_sample=False, pad_token_id=0)
    length = ids.shape[1] + NEW_TOKENS
    through_mask = model.sample(ids, sequence_length=length, top_k=1, eos_token_id=[], attention_mask=mask)
    through_start_ids = model.sample(ids, sequence_length=length, top_k=1, eos_token_id=[],
                                     start_ids=torch.tensor([ids.shape[1] - n for n in LENGTHS]))
    assert torch.equal(through_mask, expected)
    assert torch.equal(through_start_ids, expected)
    assert torch.equal(through_mask[:, : ids.shape[1]], ids)     # out[:, len:] are the new tokens


def test_right_padded_tensor_keeps_its_layout(families):
    cls, hf, path = families["llama"]
    model = cls.from_pretrained(path, batch_size=2, n_positions=128, context_length_estimate=[16]).to_neuron()
    a, b = [5, 6, 7, 8, 9, 10], [11, 12, 13]
    right = torch.tensor([a, b + [0, 0, 0]])
    mask = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0]])
    out = model.sample(right, sequence_length=26, top_k=1, eos_token_id=[], attention_mask=mask)
    assert out.shape == (2, 26) and torch.equal(out[:, :6], right)
    for i, prompt in enumerate((a, b)):
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                               pad_token_id=0)
        assert out[i, 6:].tolist() == expected[0, len(prompt):].tolist(), i


def test_start_ids_that_disagree_with_the_mask_or_the_batch_are_clear_errors(families):
    cls, _, path = families["llama"]
    model = cls.from_pretrained(path, batch_size=3, n_positions=128, context_length_estimate=[16]).to_neuron()
    ids, mask = left_padded()
    with pytest.raises(ValueError, match="disagree"):
        model.sample(ids, sequence_length=30, attention_mask=mask, start_ids=torch.tensor([0, 0, 0]))
    with pytest.raises(ValueError, match="one offset per line"):
        model.sample(ids, sequence_length=30, start_ids=torch.tensor([0, 0]))
    with pytest.raises(ValueError, match=r"start_ids must be offsets in \[0, 18\]"):
        model.sample(ids, sequence_length=30, start_ids=torch.tensor([0, 19, 0]))
    with pytest.raises(ValueError, match="not a list of sequences"):
        model.sample([[1, 2], [3], [4]], sequence_length=30, start_ids=[0, 0, 0])


@pytest.mark.parametrize("family", ["llama", "bloom"])
def test_forward_step_by_step_gives_hf_logits(families, family):
    cls, hf, path = families[family]
    model = cls.from_pretrained(path, batch_size=len(LENGTHS), n_positions=128,
                                context_length_estimate=[16, 32]).to_neuron()
    ids, mask = left_padded()
    start_ids = torch.tensor([ids.shape[1] - n for n in LENGTHS])
    with torch.no_grad():
        reference = hf(ids, attention_mask=mask).logits[:, -1]
    logits = model.forward(ids, start_ids=start_ids)
    assert logits.shape == (len(LENGTHS), 320) and relative_error(logits, reference) < 1e-4
    for step in range(5):
        token = logits.argmax(-1, keepdim=True)
        ids, mask = torch.cat([ids, token], 1), torch.cat([mask, torch.ones_like(token)], 1)
        with torch.no_grad():
            reference = hf(ids, attention_mask=mask).logits[:, -1]
        logits = model.forward(token, cache_ids=torch.tensor([ids.shape[1] - 1]), start_ids=start_ids)
        assert relative_error(logits, reference) < 1e-4, step
