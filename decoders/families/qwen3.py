"""Qwen3: Qwen2's layout without biases (unless attention_bias, then on q, k, v and the output),
with an RMS norm over each head's queries and keys before the rotary positions.

Qwen3-MoE: the same attention, and a mixture of experts for the MLP (a router choosing the top
num_experts_per_tok of num_experts SiLU-gated experts per token, their weights renormalised to
sum to 1 where norm_topk_prob says so) on every layer.
"""
from __future__ import annotations

from decoders.blocks import MLP, Decoder, MoE
from decoders.description import ConfigReader, Family
from decoders.families.llama import LAYER, llama_layout
from decoders.families.qwen2 import sliding_window
from decoders.model import DecoderForSampling


def describe(config: ConfigReader, fuse_qkv: bool = True) -> Decoder:
    bias = bool(config.get("attention_bias", default=False))
    return llama_layout(config, fuse_qkv, qkv_bias=bias, out_bias=bias, window=sliding_window(config),
                        head_norms=True)


def describe_moe(config: ConfigReader, fuse_qkv: bool = True) -> Decoder:
    # One block program serves every layer, so every layer has the experts.
    config.refuse("mlp_only_layers", bool, "some layers with a dense MLP instead of the experts")
    config.refuse("decoder_sparse_step", lambda step: step != 1, "the experts on every n-th layer only")
    hidden = int(config.get("hidden_size"))
    intermediate = int(config.get("moe_intermediate_size"))
    activation = config.get("hidden_act", default="silu")
    n_experts = int(config.get("num_experts", "num_local_experts"))
    prefixes = [f"{LAYER}mlp.experts.{e}." for e in range(n_experts)]
    experts = tuple(MLP(up=p + "up_proj", down=p + "down_proj", gate=p + "gate_proj", hidden=hidden,
                        intermediate=intermediate, activation=activation) for p in prefixes)
    moe = MoE(LAYER + "mlp.gate", experts, top_k=int(config.get("num_experts_per_tok")),
              renormalise=bool(config.get("norm_topk_prob", default=False)))
    bias = bool(config.get("attention_bias", default=False))
    return llama_layout(config, fuse_qkv, qkv_bias=bias, out_bias=bias, window=sliding_window(config),
                        mlp=moe, head_norms=True)


QWEN3 = Family("qwen3", ("qwen3",), describe)
QWEN3_MOE = Family("qwen3_moe", ("qwen3_moe",), describe_moe)


class Qwen3ForSampling(DecoderForSampling):
    family = QWEN3


class Qwen3MoeForSampling(DecoderForSampling):
    family = QWEN3_MOE
