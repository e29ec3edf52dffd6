"""OPT: learned positions read with an offset of 2, layer norms with biases, split q/k/v with
biases, a ReLU MLP, tied LM head; norms before the residual branches, or after the residual
sums (do_layer_norm_before=False, OPT-350m, whose token table is narrower than its layers)."""
from __future__ import annotations

from decoders.blocks import MLP, Attention, Decoder, DecoderLayer, Embedding, Head, Norm
from decoders.description import ConfigReader, Family
from decoders.model import DecoderForSampling

DECODER = "model.decoder."
LAYER = DECODER + "layers.{i}."
POSITION_OFFSET = 2     # OPT's learned position table keeps two rows before position 0


def describe(config: ConfigReader, fuse_qkv: bool = True) -> Decoder:
    hidden = int(config.get("hidden_size"))
    n_heads = int(config.get("num_attention_heads"))
    vocab = int(config.get("vocab_size"))
    bias = bool(config.get("enable_bias", default=True))
    config.refuse("layer_norm_elementwise_affine", lambda affine: not affine, "layer norms without weights")
    pre_norm = bool(config.get("do_layer_norm_before", default=True))
    width = int(config.get("word_embed_proj_dim", default=hidden))

    def norm(name: str) -> Norm:
        return Norm(name, hidden, "layer", bias=True, eps=1e-5)     # torch's LayerNorm default

    attention = Attention(
        out=LAYER + "self_attn.out_proj", q=LAYER + "self_attn.q_proj", k=LAYER + "self_attn.k_proj",
        v=LAYER + "self_attn.v_proj", hidden=hidden, n_heads=n_heads, n_kv_heads=n_heads,
        head_dim=hidden // n_heads, qkv_bias=bias, out_bias=bias, fused=fuse_qkv)
    mlp = MLP(up=LAYER + "fc1", down=LAYER + "fc2", hidden=hidden, intermediate=int(config.get("ffn_dim")),
              activation=config.get("activation_function", default="relu"), bias=bias)
    layer = DecoderLayer(norm(LAYER + "self_attn_layer_norm"), attention, mlp,
                         norm(LAYER + "final_layer_norm"), residual="sequential" if pre_norm else "post")
    projected = width != hidden
    embedding = Embedding(
        DECODER + "embed_tokens.weight", vocab, hidden, positions=DECODER + "embed_positions.weight",
        n_positions=int(config.get("max_position_embeddings")) + POSITION_OFFSET,
        position_offset=POSITION_OFFSET,
        projection=DECODER + "project_in" if projected else None, width=width if projected else None)
    final_norm = pre_norm and not config.get("_remove_final_layer_norm", default=False)
    tied = bool(config.get("tie_word_embeddings", default=True))
    head = Head(norm(DECODER + "final_layer_norm") if final_norm else None, vocab, hidden,
                None if tied else "lm_head.weight", tied_to=embedding.tokens,
                projection=DECODER + "project_out" if projected else None, width=width if projected else None)
    return Decoder(embedding, layer, head, int(config.get("num_hidden_layers")))


OPT = Family("opt", ("opt",), describe)


class OPTForSampling(DecoderForSampling):
    family = OPT
