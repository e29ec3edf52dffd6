"""Decoder LLM families, their configuration and the sampling API.

    decoders/
      config.py      NeuronConfig, GenerationConfig (transformers-neuronx's names)
      model.py       DecoderForSampling: from_pretrained, to_neuron, sample, forward, save, load
      families/      one short description per family (Llama, GPT-NeoX, Bloom) over the pieces
      description.py what a family description is: Family, config reading, rotary tables
      blocks/        the pieces: norm, attention, MLP, embedding, head, layer wiring; each
                     declares its parameters once (params.py: name, shape, shard axis, source)
      lowering.py    how the platform runs products and attention (plain XLA, CPU kernels)
      programs/      typed program keys, the builder writing them, buckets, the compiled set
      session/       Session (programs + weights + KV caches), the sampling loop, input checks
      checkpoints/   HF directories (safetensors, sharded, .bin), GGUF files, the default model
"""
from decoders.config import GenerationConfig, NeuronConfig, NotSupportedYet
from decoders.families.bloom import BloomForSampling
from decoders.families.gpt_neox import GPTNeoXForSampling
from decoders.families.llama import LlamaForSampling

__all__ = ["BloomForSampling", "GPTNeoXForSampling", "LlamaForSampling", "NeuronConfig", "GenerationConfig",
           "NotSupportedYet"]
