"""Llama (Llama 2 and 3, TinyLlama, SmolLM2, ...): RMS norms, SiLU-gated MLP, rotary positions,
grouped-query attention; optional attention and MLP biases.

`llama_layout` is the Llama description with the options its relatives change (Mistral,
Qwen2, Qwen3, Mixtral): attention biases, one sliding window on every layer, per-head q and k
norms, another MLP piece.
"""
from __future__ import annotations

from typing import Callable

from decoders.blocks import MLP, Attention, Decoder, DecoderLayer, Embedding, Head, MoE, Norm, Rotary
from decoders.description import ConfigReader, Family, rope_inverse_frequencies
from decoders.model import DecoderForSampling

LAYER = "model.layers.{i}."


def llama_layout(config: ConfigReader, fuse_qkv: bool, *, qkv_bias: bool, out_bias: bool,
                 window: int | None = None, mlp: MLP | MoE | None = None,
                 default_theta: float = 10000.0, head_norms: bool = False) -> Decoder:
    """A Llama-shaped decoder; `mlp` None: the gated MLP (with biases when config's mlp_bias);
    `head_norms`: RMS norms of each head's queries and keys (self_attn.q_norm, k_norm)."""
    hidden = int(config.get("hidden_size"))
    n_heads = int(config.get("num_attention_heads"))
    head_dim = int(config.get("head_dim", default=hidden // n_heads))
    eps = float(config.get("rms_norm_eps", default=1e-6))
    rope = config.rope()
    theta = float(rope.get("rope_theta") or config.get("rope_theta", default=default_theta))

    def norm(name: str, width: int = hidden) -> Norm:
        return Norm(name, width, "rms", eps=eps)

    attention = Attention(
        out=LAYER + "self_attn.o_proj", q=LAYER + "self_attn.q_proj", k=LAYER + "self_attn.k_proj",
        v=LAYER + "self_attn.v_proj", hidden=hidden, n_heads=n_heads,
        n_kv_heads=int(config.get("num_key_value_heads", default=n_heads)), head_dim=head_dim,
        qkv_bias=qkv_bias, out_bias=out_bias,
        positions=Rotary(rope_inverse_frequencies(rope, theta, head_dim)),
        window=None if window is None else int(window), fused=fuse_qkv,
        q_norm=norm(LAYER + "self_attn.q_norm", head_dim) if head_norms else None,
        k_norm=norm(LAYER + "self_attn.k_norm", head_dim) if head_norms else None)
    if mlp is None:
        mlp = MLP(up=LAYER + "mlp.up_proj", down=LAYER + "mlp.down_proj", gate=LAYER + "mlp.gate_proj",
                  hidden=hidden, intermediate=int(config.get("intermediate_size")),
                  activation=config.get("hidden_act", default="silu"),
                  bias=bool(config.get("mlp_bias", default=False)))
    return llama_stack(config, attention, mlp, norm)


def llama_stack(config: ConfigReader, attention: Attention, mlp: MLP | MoE,
                norm: Callable[[str], Norm]) -> Decoder:
    """Llama's layer wiring (a norm before attention and before the MLP, sequential residual),
    token table and final norm + LM head (tied where the config says) around `attention` and
    `mlp`; norm(name) gives a norm of the hidden width."""
    hidden, vocab = int(config.get("hidden_size")), int(config.get("vocab_size"))
    layer = DecoderLayer(norm(LAYER + "input_layernorm"), attention, mlp,
                         norm(LAYER + "post_attention_layernorm"))
    tied = bool(config.get("tie_word_embeddings", default=False))
    embedding = Embedding("model.embed_tokens.weight", vocab, hidden)
    head = Head(norm("model.norm"), vocab, hidden, None if tied else "lm_head.weight",
                tied_to=embedding.tokens)
    return Decoder(embedding, layer, head, int(config.get("num_hidden_layers")))


def describe(config: ConfigReader, fuse_qkv: bool = True) -> Decoder:
    bias = bool(config.get("attention_bias", default=False))
    return llama_layout(config, fuse_qkv, qkv_bias=bias, out_bias=bias)


LLAMA = Family("llama", ("llama",), describe)


class LlamaForSampling(DecoderForSampling):
    family = LLAMA
