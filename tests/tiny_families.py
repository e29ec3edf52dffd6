"""Tiny random GPT-NeoX and Bloom checkpoints written by HF transformers."""
from __future__ import annotations

import pathlib

import torch
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
    model = VARIANTS[variant]().eval()
    # Random init gives near-uniform logits; larger weights make greedy choices clear-cut.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    # sample(eos_token_id=[]) never stops; nor may the reference (min_length would ban the EOS id).
    model.generation_config.eos_token_id = None
    return model


def save(model, directory: pathlib.Path) -> pathlib.Path:
    model.save_pretrained(directory, safe_serialization=True)
    return directory
