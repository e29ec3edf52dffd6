"""pyhlo as a bench worker runs it: the family's *ForSampling, from_pretrained + to_neuron(),
then greedy sample(), timed token by token like its peers (tools/bench/peers.py)."""
from __future__ import annotations

import time
from typing import Any

from tools.bench import peers


def pyhlo_options(amp: str, kv_cache_dtype: str | None = None) -> dict:
    """from_pretrained() arguments of pyhlo's model at a bench precision (and KV cache type:
    None, the amp type)."""
    from decoders import NeuronConfig, QuantizationConfig

    caches = {"kv_cache_dtype": kv_cache_dtype}
    if amp == "s8":   # the prompt's activations rounded to int8, as llama.cpp's and torch's are
        return {"amp": "f32", "neuron_config": NeuronConfig(quant=QuantizationConfig(quant_dtype="s8"),
                                                            int8_activations=True, **caches)}
    if amp in ("gguf", "gguf-x8"):
        return {"amp": "f32",
                "neuron_config": NeuronConfig(gguf_blocks=True, int8_activations=amp == "gguf-x8", **caches)}
    return {"amp": amp, "neuron_config": NeuronConfig(gguf_blocks=False, **caches)}


class PyhloRunner:
    """Ours: the family's *ForSampling, from_pretrained + to_neuron, then greedy sample()."""

    engine = "pyhlo"

    def __init__(self, model_path: str, amp: str, batch: int, n_positions: int,
                 kv_cache_dtype: str | None = None, **_: Any):
        from decoders import NeuronAutoModelForCausalLM

        options = pyhlo_options(amp, kv_cache_dtype)
        self.model = NeuronAutoModelForCausalLM.from_pretrained(model_path, batch_size=batch,
                                                                n_positions=n_positions, **options)
        self.model.to_neuron()
        programs = self.model.programs
        self.info = {"programs": len(self.model.eager_programs()), "cache_hits": programs.cache_hits,
                     "compiler_calls": programs.compiler_calls,
                     "token_buckets": self.model.token_buckets, "context_buckets": self.model.context_buckets}
        lowering = self.model.lowering
        if lowering.quant is not None:
            self.info["quant"] = lowering.quant.to_dict()
        if lowering.gguf_blocks:
            self.info["gguf_blocks"] = dict(lowering.gguf_blocks)
        self.info["kv_cache"] = self.model.kv_cache.dtype
        if hasattr(lowering, "kernel_rows"):
            self.info["kernel_rows"] = dict(lowering.kernel_rows)

    def generate(self, prompts: list[list[int]], new_tokens: int) -> dict:
        streamer = peers.TimingStreamer()
        length = len(prompts[0])
        started = time.perf_counter()
        out = self.model.sample(prompts, sequence_length=length + new_tokens, top_k=1, eos_token_id=[],
                                streamer=streamer)
        finished = time.perf_counter()
        return peers.generation_record(started, streamer.token_times(started), finished,
                                       out[:, length:].tolist())
