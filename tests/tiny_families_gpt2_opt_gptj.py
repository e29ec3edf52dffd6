"""Tiny random GPT-2, OPT and GPT-J checkpoints written by HF transformers."""
from __future__ import annotations

import pathlib

import torch
from tiny_llama import as_reference
from transformers import GPT2Config, GPT2LMHeadModel, GPTJConfig, GPTJForCausalLM, OPTConfig, OPTForCausalLM

# vocab 320, hidden 64, 2 layers, 4 heads; 512 positions, so decode crosses the 128 -> 256 bucket.
# GPT-2's and GPT-J's default BOS/EOS id, 50256, lies outside the tiny vocabulary.
GPT_SHAPE = dict(vocab_size=320, n_embd=64, n_layer=2, n_head=4, n_positions=512, bos_token_id=1, eos_token_id=2)
OPT_SHAPE = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=160,
                 max_position_embeddings=512)

VARIANTS = {
    # Conv1D weights [in, out], a contiguous fused c_attn, learned positions, tied head
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(**GPT_SHAPE)),
    # norms before the residual branches, a final norm
    "opt": lambda: OPTForCausalLM(OPTConfig(**OPT_SHAPE)),
    # OPT-350m's shape: norms after the residual sums, no final norm, a token table narrower
    # than the layers (project_in / project_out)
    "opt_post_norm": lambda: OPTForCausalLM(OPTConfig(**OPT_SHAPE, do_layer_norm_before=False,
                                                      word_embed_proj_dim=32)),
    # parallel residual under one norm, interleaved rotary on 8 of 16 features, head with a bias
    "gptj": lambda: GPTJForCausalLM(GPTJConfig(**GPT_SHAPE, rotary_dim=8)),
}


def make_model(variant: str, seed: int = 0):
    torch.manual_seed(seed)
    model = as_reference(VARIANTS[variant]())
    if variant == "gptj":
        # Random init leaves the head's bias at zero: make it count.
        with torch.no_grad():
            model.lm_head.bias.normal_(0.0, 1.0)
    return model


def save(model, directory: pathlib.Path) -> pathlib.Path:
    model.save_pretrained(directory, safe_serialization=True)
    return directory
