"""Mixtral: Llama's layout with a mixture of experts for the MLP (a router choosing the top
num_experts_per_tok of num_local_experts SiLU-gated experts per token), an optional sliding
window on every layer, and rotary base 1e6 unless the config says otherwise."""
from __future__ import annotations

from decoders.blocks import MLP, Decoder, MoE
from decoders.description import ConfigReader, Family
from decoders.families.llama import LAYER, llama_layout
from decoders.model import DecoderForSampling

MOE = LAYER + "block_sparse_moe."


def describe(config: ConfigReader, fuse_qkv: bool = True) -> Decoder:
    hidden, intermediate = int(config.get("hidden_size")), int(config.get("intermediate_size"))
    activation = config.get("hidden_act", default="silu")
    # Expert e's w1 is the gate, w3 the up and w2 the down projection.
    prefixes = [f"{MOE}experts.{e}." for e in range(int(config.get("num_local_experts", "num_experts")))]
    experts = tuple(MLP(up=p + "w3", down=p + "w2", gate=p + "w1", hidden=hidden, intermediate=intermediate,
                        activation=activation) for p in prefixes)
    moe = MoE(MOE + "gate", experts, top_k=int(config.get("num_experts_per_tok")))
    return llama_layout(config, fuse_qkv, qkv_bias=False, out_bias=False, mlp=moe, default_theta=1e6,
                        window=config.get("sliding_window", default=None))


MIXTRAL = Family("mixtral", ("mixtral",), describe)


class MixtralForSampling(DecoderForSampling):
    family = MIXTRAL
