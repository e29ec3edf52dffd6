"""`pyhlo generate` and `pyhlo inspect` take any family's checkpoint: the class comes from its model_type."""
from __future__ import annotations

import pytest
import torch
from tiny_families import make_model, save
from tiny_tokenizer import make_tokenizer

from decoders import NeuronAutoModelForCausalLM
from tools.cli import main


@pytest.fixture(scope="module", params=["gpt_neox", "bloom", "qwen3", "phi3", "gemma2", "gemma3"])
def checkpoint(request, tmp_path_factory):
    directory = save(make_model(request.param), tmp_path_factory.mktemp(request.param))
    make_tokenizer().save_pretrained(directory)
    return request.param, directory


def test_generate_runs_any_family_and_prints_its_greedy_text(checkpoint, capsys):
    family, path = checkpoint
    prompt = "t5 t17 t42 t8"
    assert main(["generate", "--model", str(path), "--n-positions", "128", "--max-new-tokens", "6",
                 prompt]) == 0
    printed = capsys.readouterr().out.split()
    model = NeuronAutoModelForCausalLM.from_pretrained(path, n_positions=128).to_neuron()
    ids = make_tokenizer()(prompt)["input_ids"]
    expected = model.sample(torch.tensor([ids]), sequence_length=len(ids) + 6, top_k=1)
    assert printed == make_tokenizer().decode(expected[0, len(ids):]).split()


def test_inspect_shows_the_family_and_its_pieces(checkpoint, capsys):
    family, path = checkpoint
    assert main(["inspect", str(path), "--n-positions", "128"]) == 0
    out = capsys.readouterr().out
    assert f"({family})" in out
    pieces = {"gpt_neox": "layer norm, gelu MLP, rotary positions, parallel residual",
              "bloom": "layer norm, gelu_tanh MLP, alibi positions, sequential residual, tied LM head",
              "qwen3": "rms norm, gated silu MLP, rotary positions, sequential residual, tied LM head",
              "phi3": "rms norm, gated silu MLP, rotary positions, sliding window 48 on 2 of 2 layers, "
                      "sequential residual",
              "gemma2": "rms norm, gated gelu_pytorch_tanh MLP, rotary positions, sliding window 48 on 2 "
                        "of 3 layers, sequential residual, tied LM head",
              "gemma3": "sliding window 48 on 2 of 3 layers"}
    # The fused q|k|v weight and the checkpoint tensors it is read from.
    qkv_source = {"gpt_neox": "query_key_value", "bloom": "query_key_value", "qwen3": "self_attn.q_proj",
                  "phi3": "self_attn.qkv_proj", "gemma2": "q_proj", "gemma3": "q_proj"}
    assert pieces[family] in out
    assert "attn.qkv.weight" in out and "column" in out and qkv_source[family] in out
    if family == "qwen3":
        assert "attn.q_norm.weight" in out and "attn.k_norm.weight" in out
    if family == "phi3":
        assert "mlp.gate_up.weight" in out and "mlp.gate_up_proj" in out
