"""GPT-J: a parallel residual under one shared layer norm, interleaved rotary positions on the
first rotary_dim features of each head, split q/k/v without biases, a tanh-GELU MLP with
biases, and an LM head with a bias."""
from __future__ import annotations

from decoders.blocks import MLP, Attention, Decoder, DecoderLayer, Embedding, Head, Norm, Rotary
from decoders.description import ConfigReader, Family, rope_inverse_frequencies
from decoders.model import DecoderForSampling

LAYER = "transformer.h.{i}."


def describe(config: ConfigReader, fuse_qkv: bool = True) -> Decoder:
    hidden = int(config.get("n_embd", "hidden_size"))
    n_heads = int(config.get("n_head", "num_attention_heads"))
    head_dim = hidden // n_heads
    vocab = int(config.get("vocab_size"))
    eps = float(config.get("layer_norm_epsilon", default=1e-5))
    rotary_dim = int(config.get("rotary_dim", default=head_dim))

    def norm(name: str) -> Norm:
        return Norm(name, hidden, "layer", bias=True, eps=eps)

    attention = Attention(
        out=LAYER + "attn.out_proj", q=LAYER + "attn.q_proj", k=LAYER + "attn.k_proj",
        v=LAYER + "attn.v_proj", hidden=hidden, n_heads=n_heads, n_kv_heads=n_heads, head_dim=head_dim,
        positions=Rotary(rope_inverse_frequencies({}, 10000.0, rotary_dim), style="interleaved"),
        fused=fuse_qkv)
    mlp = MLP(up=LAYER + "mlp.fc_in", down=LAYER + "mlp.fc_out", hidden=hidden,
              intermediate=int(config.get("n_inner", default=4 * hidden)),
              activation=config.get("activation_function", default="gelu_new"), bias=True)
    layer = DecoderLayer(norm(LAYER + "ln_1"), attention, mlp, None, residual="parallel")
    tied = bool(config.get("tie_word_embeddings", default=False))
    embedding = Embedding("transformer.wte.weight", vocab, hidden)
    head = Head(norm("transformer.ln_f"), vocab, hidden, None if tied else "lm_head.weight",
                tied_to=embedding.tokens, bias="lm_head.bias")
    return Decoder(embedding, layer, head, int(config.get("n_layer", "num_hidden_layers")))


GPTJ = Family("gptj", ("gptj",), describe)


class GPTJForSampling(DecoderForSampling):
    family = GPTJ
