"""Tiny random Mistral, Qwen2 and Mixtral checkpoints written by HF transformers."""
from __future__ import annotations

import pathlib

import torch
from tiny_llama import as_reference
from transformers import (
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)
WINDOW = 48                  # a 150-token sequence crosses it

VARIANTS = {
    # sliding window on every layer, untied head
    "mistral": lambda: MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=WINDOW, tie_word_embeddings=False)),
    # Mistral v0.2 on: no window
    "mistral_full": lambda: MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=None)),
    # q, k, v biases, head tied to the embedding (as Qwen2.5-0.5B), no window
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**SHAPE, tie_word_embeddings=True, rope_theta=1e6)),
    # untied head, sliding window on every layer (max_window_layers=0)
    "qwen2_window": lambda: Qwen2ForCausalLM(Qwen2Config(**SHAPE, tie_word_embeddings=False, use_sliding_window=True,
                                                         sliding_window=WINDOW, max_window_layers=0)),
    # 4 experts, top 2
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2)),
}


def make_model(variant: str, seed: int = 0):
    torch.manual_seed(seed)
    model = as_reference(VARIANTS[variant]())
    with torch.no_grad():
        # HF initialises biases to 0; random ones check that they are read and added.
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn_like(p))
    return model


def save(model, directory: pathlib.Path) -> pathlib.Path:
    model.save_pretrained(directory, safe_serialization=True)
    return directory
