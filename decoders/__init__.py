"""Decoder LLM families, their configuration and the sampling API.

    decoders/
      config.py      NeuronConfig, GenerationConfig, QuantizationConfig, GQA (transformers-neuronx's names)
      model.py       DecoderForSampling: from_pretrained, to_neuron, sample, forward, save, load
      auto.py        NeuronAutoModelForCausalLM: the family class picked by the checkpoint's model_type
      hf_adapter.py  HuggingFaceGenerationModelAdapter: HF generate() over a compiled model
      families/      one short description per family (Llama, Mistral, Mixtral, Qwen2, Qwen3,
                     Qwen3-MoE, Phi-3/Phi-4, GPT-NeoX, Bloom, GPT-2, OPT, GPT-J)
      description.py what a family description is: Family, config reading, rotary tables
      blocks/        the pieces: norm, attention, MLP, mixture of experts, embedding, head, layer wiring; each
                     declares its parameters once (params.py: name, shape, shard axis, source)
      lowering.py    how the platform runs products and attention (plain XLA, CPU kernels,
                     tensor parallelism's collectives)
      platform_choice.py  which lowering runs on this backend (the one place that looks at it)
      kernel_calibration.py  the CPU kernels timed against XLA's dot once per machine
      parallel/      tensor parallelism: weight sharding, KVSharding (how keys and values are
                     shared out, decided once per model), each replica's program helpers
      programs/      typed program keys, the builder writing them, buckets, the compiled set
      session/       Session (programs + weights + KV caches), the sampling loop, input checks
      checkpoints/   HF directories (safetensors, sharded, .bin), GGUF files, the default model
      weights/       stored.py: the forms quantized weights are stored in (int8 rows, GGUF blocks);
                     quantize.py: their numpy quantization and dequantization
"""
from decoders.auto import NeuronAutoModelForCausalLM
from decoders.config import (
    GQA,
    ContinuousBatchingConfig,
    GenerationConfig,
    NeuronConfig,
    NotSupportedYet,
    QuantizationConfig,
)
from decoders.families.bloom import BloomForSampling
from decoders.families.gemma2 import Gemma2ForSampling
from decoders.families.gemma3 import Gemma3ForSampling
from decoders.families.gpt2 import GPT2ForSampling, GPT2ForSamplingWithContextBroadcasting
from decoders.families.gpt_neox import GPTNeoXForSampling
from decoders.families.gptj import GPTJForSampling
from decoders.families.llama import LlamaForSampling
from decoders.families.mistral import MistralForSampling
from decoders.families.mixtral import MixtralForSampling
from decoders.families.opt import OPTForSampling
from decoders.families.phi3 import Phi3ForSampling
from decoders.families.qwen2 import Qwen2ForSampling
from decoders.families.qwen3 import Qwen3ForSampling, Qwen3MoeForSampling
from decoders.session.speculative import SpeculativeGenerator

__all__ = ["BloomForSampling", "GPT2ForSampling", "GPT2ForSamplingWithContextBroadcasting", "GPTJForSampling",
           "GPTNeoXForSampling", "Gemma2ForSampling", "Gemma3ForSampling", "GQA", "GenerationConfig",
           "HuggingFaceGenerationModelAdapter",
           "LlamaForSampling", "MistralForSampling", "MixtralForSampling", "NeuronAutoModelForCausalLM",
           "NeuronConfig", "ContinuousBatchingConfig", "NotSupportedYet", "OPTForSampling", "Phi3ForSampling",
           "QuantizationConfig", "Qwen2ForSampling", "Qwen3ForSampling", "Qwen3MoeForSampling",
           "SpeculativeGenerator"]


def __getattr__(name: str):
    # The adapter subclasses transformers' PreTrainedModel: transformers is imported on first use only.
    if name == "HuggingFaceGenerationModelAdapter":
        from decoders.hf_adapter import HuggingFaceGenerationModelAdapter

        return HuggingFaceGenerationModelAdapter
    raise AttributeError(f"module 'decoders' has no attribute {name!r}")
