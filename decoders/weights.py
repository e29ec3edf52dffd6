"""Checkpoint tensors rearranged into the layouts the programs take.

Linear weights are stored [out, in] by torch; the block programs take them
[in, out], with q/k/v and gate/up fused along the output dimension. The LM head
stays [vocab, hidden] (the embedding table itself when embeddings are tied).
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from decoders.checkpoint import Checkpoint
from decoders.family import DecoderFamily, ModelDims
from pyhlo.dtypes import numpy_dtype


def _get(checkpoint: Checkpoint, name: str, shape: tuple[int, ...]) -> np.ndarray:
    checkpoint.check_shape(name, shape)
    return checkpoint.get(name)


def _linear(checkpoint: Checkpoint, names: list[str], out_features: list[int], in_features: int,
            layout: str) -> np.ndarray:
    """torch Linear weights [out, in], fused along `out`, in the program's layout."""
    fused = np.concatenate([_get(checkpoint, name, (n_out, in_features))
                            for name, n_out in zip(names, out_features)], axis=0)
    return fused.T if layout == "in_out" else fused


def layer_weights(checkpoint: Checkpoint, family: DecoderFamily, dims: ModelDims,
                  layer: int, dtype: str, layout: str = "in_out") -> dict[str, np.ndarray]:
    """One layer's weights by block parameter name, as contiguous arrays of `dtype`."""
    names = {key: template.format(i=layer) for key, template in family.layer_names.items()}
    h, q, kv, inter = dims.hidden_size, dims.q_size, dims.kv_size, dims.intermediate_size
    weights = {
        "input_norm": _get(checkpoint, names["input_norm"], (h,)),
        "qkv_weight": _linear(checkpoint, [names["q"], names["k"], names["v"]], [q, kv, kv], h, layout),
        "o_weight": _linear(checkpoint, [names["o"]], [h], q, layout),
        "post_norm": _get(checkpoint, names["post_norm"], (h,)),
        "gate_up_weight": _linear(checkpoint, [names["gate"], names["up"]], [inter, inter], h, layout),
        "down_weight": _linear(checkpoint, [names["down"]], [h], inter, layout),
    }
    np_dtype = numpy_dtype(dtype)
    return {key: np.ascontiguousarray(value, dtype=np_dtype) for key, value in weights.items()}


def iter_layers(checkpoint: Checkpoint, family: DecoderFamily, dims: ModelDims,
                dtype: str, layout: str = "in_out") -> Iterator[dict[str, np.ndarray]]:
    for layer in range(dims.n_layers):
        yield layer_weights(checkpoint, family, dims, layer, dtype, layout)


def shared_weights(checkpoint: Checkpoint, family: DecoderFamily, dims: ModelDims,
                   dtype: str, layout: str = "in_out", head_dtype: str = "f32") -> dict[str, np.ndarray]:
    """Embedding table [vocab, hidden] (`dtype`), final norm and LM head (`head_dtype`,
    in the program's layout).

    Tied embeddings of one type are kept once: `embed_weight` is then None and the
    embed program reads the LM head table (its rows or columns).
    """
    v, h = dims.vocab_size, dims.hidden_size

    def contiguous(array, element_type):
        return np.ascontiguousarray(array, dtype=numpy_dtype(element_type))

    embed = _get(checkpoint, family.embed_name, (v, h))
    head = embed if dims.tie_word_embeddings else _get(checkpoint, family.lm_head_name, (v, h))
    one_table = dims.tie_word_embeddings and head_dtype == dtype
    return {
        "embed_weight": None if one_table else contiguous(embed, dtype),
        "final_norm": contiguous(_get(checkpoint, family.final_norm_name, (h,)), dtype),
        "lm_head_weight": contiguous(head.T if layout == "in_out" else head, head_dtype),
    }
