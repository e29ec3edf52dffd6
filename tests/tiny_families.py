"""Tiny random checkpoints of every family but Llama (tests/tiny_llama.py), written by HF
transformers: vocab 320, hidden 64 (Bloom 96), 2 layers, 512 positions, so a 150-token
sequence crosses the 128 -> 256 token bucket."""
from __future__ import annotations

import pathlib

import torch
from tiny_llama import as_reference
from transformers import (
    BloomConfig,
    BloomForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    GPTJConfig,
    GPTJForCausalLM,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

NEOX_SHAPE = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=160, max_position_embeddings=512)
# GPT-2's and GPT-J's default BOS/EOS id, 50256, lies outside the tiny vocabulary.
GPT_SHAPE = dict(vocab_size=320, n_embd=64, n_layer=2, n_head=4, n_positions=512, bos_token_id=1,
                 eos_token_id=2)
OPT_SHAPE = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=160,
                 max_position_embeddings=512)
LLAMA_SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                   rms_norm_eps=1e-5)
WINDOW = 48                  # a 150-token sequence crosses it
ROTARY_PAIRS = 6             # Phi-4-mini's rotary over 3/4 of each head: 12 of 16 features


def longrope_scaling(original: int) -> dict:
    """Phi-3.5 / Phi-4-mini's rope_scaling: LongRoPE factors per rotary pair, short and long."""
    gen = torch.Generator().manual_seed(7)
    return {"rope_type": "longrope", "partial_rotary_factor": 0.75, "rope_theta": 10000.0,
            "original_max_position_embeddings": original,
            "short_factor": (1 + torch.rand(ROTARY_PAIRS, generator=gen)).tolist(),
            "long_factor": (1 + 10 * torch.rand(ROTARY_PAIRS, generator=gen)).tolist()}

# Gemma: a head_dim apart from hidden / heads, scores scaled by a query_pre_attn_scalar apart
# from head_dim, soft-capping tight enough to bite; HF's eager attention (the one that soft-caps).
GEMMA_SHAPE = dict(LLAMA_SHAPE, num_hidden_layers=3, head_dim=24, query_pre_attn_scalar=20,
                   sliding_window=WINDOW, attn_implementation="eager")

VARIANTS = {
    # parallel residual, rotary on a quarter of each head, untied head
    "gpt_neox": lambda: GPTNeoXForCausalLM(GPTNeoXConfig(**NEOX_SHAPE, rotary_pct=0.25,
                                                         use_parallel_residual=True)),
    # sequential residual, rotary on half of each head, tanh GELU
    "gpt_neox_sequential": lambda: GPTNeoXForCausalLM(GPTNeoXConfig(
        **NEOX_SHAPE, rotary_pct=0.5, use_parallel_residual=False, hidden_act="gelu_new")),
    # ALiBi, embedding layer norm, tied head; 6 heads: ALiBi's slopes for a head count that
    # is not a power of two
    "bloom": lambda: BloomForCausalLM(BloomConfig(vocab_size=320, hidden_size=96, n_layer=2, n_head=6)),
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
    # sliding window on every layer, untied head
    "mistral": lambda: MistralForCausalLM(MistralConfig(**LLAMA_SHAPE, sliding_window=WINDOW,
                                                        tie_word_embeddings=False)),
    # Mistral v0.2 on: no window
    "mistral_full": lambda: MistralForCausalLM(MistralConfig(**LLAMA_SHAPE, sliding_window=None)),
    # q, k, v biases, head tied to the embedding (as Qwen2.5-0.5B), no window
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**LLAMA_SHAPE, tie_word_embeddings=True, rope_theta=1e6)),
    # untied head, sliding window on every layer (max_window_layers=0)
    "qwen2_window": lambda: Qwen2ForCausalLM(Qwen2Config(**LLAMA_SHAPE, tie_word_embeddings=False,
                                                         use_sliding_window=True, sliding_window=WINDOW,
                                                         max_window_layers=0)),
    # 4 experts, top 2
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(**LLAMA_SHAPE, num_local_experts=4,
                                                        num_experts_per_tok=2)),
    # per-head q and k norms; heads wider than hidden / heads (as Qwen3's 128 over 1024 / 16), tied
    # head (as Qwen3-0.6B)
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**LLAMA_SHAPE, head_dim=32, tie_word_embeddings=True)),
    # 4 experts of 32 rows, top 2, the kept probabilities not renormalised (Mixtral's are)
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(**LLAMA_SHAPE, head_dim=16, num_experts=4,
                                                            num_experts_per_tok=2, moe_intermediate_size=32,
                                                            norm_topk_prob=False)),
    # Phi-3-mini: fused qkv_proj and gate_up_proj, grouped-query heads, a sliding window on every
    # layer, untied head
    "phi3": lambda: Phi3ForCausalLM(Phi3Config(**LLAMA_SHAPE, sliding_window=WINDOW, pad_token_id=0,
                                               bos_token_id=1, eos_token_id=2)),
    # Phi-4-mini: rotary on 3/4 of each head, LongRoPE (a model of up to 512 positions runs its
    # short factors; max_position_embeddings 4096 sets the attention factor), tied head
    "phi3_longrope": lambda: Phi3ForCausalLM(Phi3Config(
        **{**LLAMA_SHAPE, "max_position_embeddings": 4096}, original_max_position_embeddings=512,
        rope_parameters=longrope_scaling(512), tie_word_embeddings=True, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)),
    # 3 layers: sliding window, global, sliding window (HF's default layer_types); tied head
    "gemma2": lambda: Gemma2ForCausalLM(Gemma2Config(**GEMMA_SHAPE, attn_logit_softcapping=3.0,
                                                     final_logit_softcapping=8.0)),
    # sliding window, sliding window, global (sliding_window_pattern 3); per-head q/k norms; the
    # sliding-window layers' rotary base 10 000, the global layer's 1e6 with linear scaling
    "gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(
        **GEMMA_SHAPE, sliding_window_pattern=3, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0}})),
}


def make_model(variant: str, seed: int = 0):
    torch.manual_seed(seed)
    model = as_reference(VARIANTS[variant]())
    with torch.no_grad():
        # HF initialises biases to 0 and norms to 1; random ones check that they are read and added.
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn_like(p))
            elif variant.startswith("gemma") and name.endswith("norm.weight"):
                # Gemma's norms scale by 1 + weight, initialised to 0: random ones check the offset.
                p.copy_(torch.randn_like(p) * 0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1 + 0.5 * torch.randn_like(p))
    return model


def save(model, directory: pathlib.Path) -> pathlib.Path:
    model.save_pretrained(directory, safe_serialization=True)
    return directory
