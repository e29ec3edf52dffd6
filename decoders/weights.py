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


def _linear(checkpoint: Checkpoint, name: str, out_features: int, in_features: int) -> np.ndarray:
    return _get(checkpoint, name, (out_features, in_features)).T


def layer_weights(checkpoint: Checkpoint, family: DecoderFamily, dims: ModelDims,
                  layer: int, dtype: str) -> dict[str, np.ndarray]:
    """One layer's weights by block parameter name, as contiguous arrays of `dtype`."""
    names = {key: template.format(i=layer) for key, template in family.layer_names.items()}
    h, q, kv, inter = dims.hidden_size, dims.q_size, dims.kv_size, dims.intermediate_size
    weights = {
        "input_norm": _get(checkpoint, names["input_norm"], (h,)),
        "qkv_weight": np.concatenate([
            _linear(checkpoint, names["q"], q, h),
            _linear(checkpoint, names["k"], kv, h),
            _linear(checkpoint, names["v"], kv, h),
        ], axis=1),
        "o_weight": _linear(checkpoint, names["o"], h, q),
        "post_norm": _get(checkpoint, names["post_norm"], (h,)),
        "gate_up_weight": np.concatenate([
            _linear(checkpoint, names["gate"], inter, h),
            _linear(checkpoint, names["up"], inter, h),
        ], axis=1),
        "down_weight": _linear(checkpoint, names["down"], h, inter),
    }
    np_dtype = numpy_dtype(dtype)
    return {key: np.ascontiguousarray(value, dtype=np_dtype) for key, value in weights.items()}


def iter_layers(checkpoint: Checkpoint, family: DecoderFamily, dims: ModelDims,
                dtype: str) -> Iterator[dict[str, np.ndarray]]:
    for layer in range(dims.n_layers):
        yield layer_weights(checkpoint, family, dims, layer, dtype)


def shared_weights(checkpoint: Checkpoint, family: DecoderFamily, dims: ModelDims,
                   dtype: str) -> dict[str, np.ndarray]:
    """Embedding table, final norm and LM head (None when tied to the embedding)."""
    np_dtype = numpy_dtype(dtype)
    v, h = dims.vocab_size, dims.hidden_size
    embed = _get(checkpoint, family.embed_name, (v, h))
    weights = {
        "embed_weight": np.ascontiguousarray(embed, dtype=np_dtype),
        "final_norm": np.ascontiguousarray(_get(checkpoint, family.final_norm_name, (h,)), dtype=np_dtype),
        "lm_head_weight": None,
    }
    if not dims.tie_word_embeddings:
        weights["lm_head_weight"] = np.ascontiguousarray(
            _get(checkpoint, family.lm_head_name, (v, h)), dtype=np_dtype
        )
    return weights
