"""Model families: each a short description over the shared pieces (decoders/blocks/).

    sampling_class("gpt_neox")     # -> GPTNeoXForSampling
"""
from __future__ import annotations

from decoders.families.bloom import BloomForSampling
from decoders.families.gpt_neox import GPTNeoXForSampling
from decoders.families.llama import LlamaForSampling
from decoders.model import DecoderForSampling

CLASSES: tuple[type[DecoderForSampling], ...] = (LlamaForSampling, GPTNeoXForSampling, BloomForSampling)


def sampling_class(model_type: str | None) -> type[DecoderForSampling]:
    """The *ForSampling class that runs checkpoints of `model_type` (config.json's)."""
    for cls in CLASSES:
        if model_type in cls.family.model_types:
            return cls
    known = ", ".join(t for cls in CLASSES for t in cls.family.model_types)
    raise ValueError(f"model_type {model_type!r} is not supported; supported: {known}")


def open_model(path, **kwargs) -> DecoderForSampling:
    """from_pretrained() of the family that runs the checkpoint at `path` (by its model_type)."""
    from decoders.checkpoints import open_checkpoint

    with open_checkpoint(path) as checkpoint:
        model_type = checkpoint.config.get("model_type")
    return sampling_class(model_type).from_pretrained(path, **kwargs)
