"""Qwen2 (and Qwen2.5): Llama's layout with biases on q, k and v (none on the output), tied or
untied embeddings, and a sliding window where use_sliding_window says (every layer or none)."""
from __future__ import annotations

from decoders.blocks import Decoder
from decoders.config import NotSupportedYet
from decoders.description import ConfigReader, Family
from decoders.families.llama import llama_layout
from decoders.model import DecoderForSampling


def sliding_window(config: ConfigReader) -> int | None:
    """As HF's Qwen2Config: with use_sliding_window, the layers listed "sliding_attention" in
    layer_types, or else layers max_window_layers on, attend within sliding_window."""
    if not config.get("use_sliding_window", default=False):
        return None
    n_layers = int(config.get("num_hidden_layers"))
    first = int(config.get("max_window_layers", default=28))
    kinds = config.get("layer_types", default=None) or [
        "sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    sliding = {kind == "sliding_attention" for kind in kinds}
    if sliding == {True, False}:
        # One block program serves every layer, so every layer has the same attention.
        raise NotSupportedYet(f"{config.family}: a sliding window on only some layers "
                              f"({kinds.count('sliding_attention')} of {len(kinds)}) is not supported yet; "
                              "every layer or none is")
    window = config.config.get("sliding_window", 4096)    # HF's default; an explicit null is no window
    return window if sliding == {True} else None


def describe(config: ConfigReader, fuse_qkv: bool = True) -> Decoder:
    return llama_layout(config, fuse_qkv, qkv_bias=True, out_bias=False, window=sliding_window(config))


QWEN2 = Family("qwen2", ("qwen2",), describe)


class Qwen2ForSampling(DecoderForSampling):
    family = QWEN2
