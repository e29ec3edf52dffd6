"""Decoder LLM families, their configuration and the sampling API."""
from decoders.config import GenerationConfig, NeuronConfig, NotSupportedYet
from decoders.llama import LlamaForSampling

__all__ = ["LlamaForSampling", "NeuronConfig", "GenerationConfig", "NotSupportedYet"]
