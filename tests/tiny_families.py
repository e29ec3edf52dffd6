"""Tiny random GPT-NeoX and Bloom checkpoints written by HF transformers."""
from __future__ import annotations

import pathlib

import torch
from tiny_llama import as_reference
from transformers import BloomConfig, BloomForCausalLM, GPTNeoXConfig, GPTNeoXForCausalLM

SHAPE = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2)

VARIANTS = {
    # parallel residual, rotary on a quarter of each head, untied head
    "gpt_neox": lambda: GPTNeoXForCausalLM(GPTNeoXConfig(
        **SHAPE, num_attention_heads=4, intermediate_size=160, max_position_embeddings=512,
        rotary_pct=0.25, use_parallel_residual=True)),
    # sequential residual, rotary on half of each head, tanh GELU
    "gpt_neox_sequential": lambda: GPTNeoXForCausalLM(GPTNeoXConfig(
        **SHAPE, num_attention_heads=4, intermediate_size=160, max_position_embeddings=512,
        rotary_pct=0.5, use_parallel_residual=False, hidden_act="gelu_new")),
    # ALiBi, embedding layer norm, tied head; 6 heads: ALiBi's slopes for a head count that
    # is not a power of two
    "bloom": lambda: BloomForCausalLM(BloomConfig(**{**SHAPE, "hidden_size": 96}, n_head=6)),
}


def make_model(variant: str, seed: int = 0):
    torch.manual_seed(seed)
    return as_reference(VARIANTS[variant]())


def save(model, directory: pathlib.Path) -> pathlib.Path:
    model.save_pretrained(directory, safe_serialization=True)
    return directory
