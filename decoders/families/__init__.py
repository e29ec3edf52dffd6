"""Model families: each a short description over the shared pieces (decoders/blocks/).

    sampling_class("gpt_neox")     # -> GPTNeoXForSampling (NeuronAutoModelForCausalLM's lookup)
"""
from __future__ import annotations

from decoders.families.bloom import BloomForSampling
from decoders.families.gemma2 import Gemma2ForSampling
from decoders.families.gemma3 import Gemma3ForSampling
from decoders.families.gpt2 import GPT2ForSampling
from decoders.families.gpt_neox import GPTNeoXForSampling
from decoders.families.gptj import GPTJForSampling
from decoders.families.llama import LlamaForSampling
from decoders.families.mistral import MistralForSampling
from decoders.families.mixtral import MixtralForSampling
from decoders.families.opt import OPTForSampling
from decoders.families.phi3 import Phi3ForSampling
from decoders.families.qwen2 import Qwen2ForSampling
from decoders.families.qwen3 import Qwen3ForSampling, Qwen3MoeForSampling
from decoders.model import DecoderForSampling

CLASSES: tuple[type[DecoderForSampling], ...] = (LlamaForSampling, GPTNeoXForSampling, BloomForSampling,
                                                 GPT2ForSampling, OPTForSampling, GPTJForSampling,
                                                 MistralForSampling, Qwen2ForSampling, MixtralForSampling,
                                                 Qwen3ForSampling, Qwen3MoeForSampling, Phi3ForSampling,
                                                 Gemma2ForSampling, Gemma3ForSampling)


def sampling_class(model_type: str | None) -> type[DecoderForSampling]:
    """The *ForSampling class that runs checkpoints of `model_type` (config.json's)."""
    for cls in CLASSES:
        if model_type in cls.family.model_types:
            return cls
    known = ", ".join(t for cls in CLASSES for t in cls.family.model_types)
    raise ValueError(f"model_type {model_type!r} is not supported; supported: {known}")

