"""Tiny random Llama checkpoints written by HF transformers, in every checkpoint format."""
from __future__ import annotations

import pathlib

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VARIANTS = {
    # multi-head attention, separate LM head
    "mha": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
    # grouped-query attention, LM head tied to the embedding, Llama 3 rope scaling
    "gqa_tied_llama3": dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64),
    ),
    # biases on q, k, v, o (attention_bias) and on gate, up, down (mlp_bias), as some Llama
    # derivatives have them
    "biases": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                   attention_bias=True, mlp_bias=True),
}

FORMATS = {
    "safetensors": dict(safe_serialization=True),
    "sharded_safetensors": dict(safe_serialization=True, max_shard_size="40KB"),
    "bin": dict(safe_serialization=False),
    "sharded_bin": dict(safe_serialization=False, max_shard_size="40KB"),
}


def make_model(variant: str, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
                         **VARIANTS[variant])
    return as_reference(LlamaForCausalLM(config))


def as_reference(model):
    """A random HF model made a good reference: clear-cut greedy choices, no EOS."""
    model.eval()
    # Random init gives near-uniform logits; larger weights make greedy choices clear-cut.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    # sample(eos_token_id=[]) never stops; nor may the reference (min_length would ban the EOS id).
    model.generation_config.eos_token_id = None
    return model


def save(model: LlamaForCausalLM, directory: pathlib.Path, fmt: str) -> pathlib.Path:
    model.save_pretrained(directory, **FORMATS[fmt])
    return directory
