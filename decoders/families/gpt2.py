"""GPT-2: learned absolute positions, layer norms with biases, a fused contiguous q|k|v
projection and a tanh-GELU MLP, all Conv1D weights stored [in, out], tied LM head."""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from decoders.blocks import MLP, Attention, Decoder, DecoderLayer, Embedding, Head, Norm
from decoders.description import ConfigReader, Family
from decoders.model import DecoderForSampling

LAYER = "transformer.h.{i}."


def describe(config: ConfigReader, fuse_qkv: bool = True) -> Decoder:
    hidden = int(config.get("n_embd", "hidden_size"))
    n_heads = int(config.get("n_head", "num_attention_heads"))
    vocab = int(config.get("vocab_size"))
    eps = float(config.get("layer_norm_epsilon", default=1e-5))
    config.refuse("scale_attn_by_inverse_layer_idx", bool,
                  "scores scaled by 1 / (layer + 1): one block per layer")
    config.refuse("scale_attn_weights", lambda scaled: not scaled, "scores not scaled by 1 / sqrt(head_dim)")
    config.refuse("add_cross_attention", bool, "cross-attention to an encoder's states")

    def norm(name: str) -> Norm:
        return Norm(name, hidden, "layer", bias=True, eps=eps)

    attention = Attention(out=LAYER + "attn.c_proj", qkv=LAYER + "attn.c_attn", qkv_layout="contiguous",
                          stored_in_out=True, hidden=hidden, n_heads=n_heads, n_kv_heads=n_heads,
                          head_dim=hidden // n_heads, qkv_bias=True, out_bias=True, fused=fuse_qkv)
    mlp = MLP(up=LAYER + "mlp.c_fc", down=LAYER + "mlp.c_proj", hidden=hidden,
              intermediate=int(config.get("n_inner", default=4 * hidden)),
              activation=config.get("activation_function", default="gelu_new"), bias=True, stored_in_out=True)
    layer = DecoderLayer(norm(LAYER + "ln_1"), attention, mlp, norm(LAYER + "ln_2"))
    embedding = Embedding("transformer.wte.weight", vocab, hidden, positions="transformer.wpe.weight",
                          n_positions=int(config.get("n_positions", "max_position_embeddings")))
    tied = bool(config.get("tie_word_embeddings", default=True))
    head = Head(norm("transformer.ln_f"), vocab, hidden, None if tied else "lm_head.weight",
                tied_to=embedding.tokens)
    return Decoder(embedding, layer, head, int(config.get("n_layer", "num_hidden_layers")))


GPT2 = Family("gpt2", ("gpt2",), describe)


class GPT2ForSampling(DecoderForSampling):
    family = GPT2


class GPT2ForSamplingWithContextBroadcasting(GPT2ForSampling):
    """Several continuations of each prompt: sample() takes `prompt_batch_size` prompts and
    returns `batch_size` lines, prompt i's continuations in lines i * r .. i * r + r - 1
    (r = batch_size // prompt_batch_size).

    transformers-neuronx encodes each prompt once and broadcasts its KV cache; this class
    repeats each prompt line r times before an ordinary prefill of batch_size lines, so
    prefill costs batch_size lines, not prompt_batch_size.
    """

    def __init__(self, checkpoint_path: str | os.PathLike, batch_size: int = 1, prompt_batch_size: int = 1,
                 **kwargs: Any):
        if not isinstance(prompt_batch_size, int) or prompt_batch_size < 1:
            raise ValueError(f"prompt_batch_size must be an int >= 1, got {prompt_batch_size!r}")
        if isinstance(batch_size, int) and batch_size % prompt_batch_size:
            raise ValueError(f"batch_size {batch_size} must be a multiple of prompt_batch_size "
                             f"{prompt_batch_size}")
        super().__init__(checkpoint_path, batch_size=batch_size, **kwargs)
        self.prompt_batch_size = prompt_batch_size

    def sample(self, input_ids: Any, sequence_length: int, start_ids: Any = None, *args: Any,
               attention_mask: Any = None, **kwargs: Any):
        """sample() of the prompts, each line repeated; per-line settings (top_k, ...) are per output line."""
        repeats = self.batch_size // self.prompt_batch_size
        if isinstance(input_ids, (list, tuple)) and input_ids and not np.isscalar(input_ids[0]):
            lines = len(input_ids)
            input_ids = [line for line in input_ids for _ in range(repeats)]
        else:
            input_ids = np.atleast_2d(np.asarray(input_ids))
            lines = input_ids.shape[0]
            input_ids = np.repeat(input_ids, repeats, axis=0)
        if lines != self.prompt_batch_size:
            raise ValueError(f"got {lines} prompts; the model takes "
                             f"prompt_batch_size={self.prompt_batch_size}")
        if attention_mask is not None:
            attention_mask = np.repeat(np.atleast_2d(np.asarray(attention_mask)), repeats, axis=0)
        if start_ids is not None:
            start_ids = np.repeat(np.atleast_1d(np.asarray(start_ids)), repeats, axis=0)
        return super().sample(input_ids, sequence_length, start_ids, *args, attention_mask=attention_mask,
                              **kwargs)
