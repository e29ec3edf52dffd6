"""Mistral: Llama's layout, without attention biases, with a sliding window on every layer
(config's sliding_window; None: full attention, as Mistral v0.2 on)."""
from __future__ import annotations

from decoders.blocks import Decoder
from decoders.description import ConfigReader, Family
from decoders.families.llama import llama_layout
from decoders.model import DecoderForSampling


def describe(config: ConfigReader, fuse_qkv: bool = True) -> Decoder:
    return llama_layout(config, fuse_qkv, qkv_bias=False, out_bias=False,
                        window=config.get("sliding_window", default=None))


MISTRAL = Family("mistral", ("mistral",), describe)


class MistralForSampling(DecoderForSampling):
    family = MISTRAL
