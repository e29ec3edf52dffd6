"""DecoderForSampling: from_pretrained -> to_neuron -> sample, for any decoder family.

A family subclass only names its `DecoderFamily` description; everything here is
shared. The host loop dispatches pure-function executables: embed, then the
block program once per layer (with that layer's weights and KV caches, updated
in place), then the LM head and the sampler. Token ids stay on the device between
steps; logits are never downloaded unless no_repeat_ngram_size asks for them.
"""
from __future__ import annotations

import json
import logging
import os
import pathlib
import time
from typing import Any

from decoders import buckets as bucketing
from decoders.checkpoint import open_checkpoint
from decoders.config import GenerationConfig, NeuronConfig, NotSupportedYet, element_type_of_amp
from decoders.family import DecoderFamily, dims_from_config
from decoders.graph import GraphBuilder, Program
from decoders.inputs import check_sampling, parse_prompts, per_line
from decoders.programs import ProgramSet
from decoders.weights import iter_layers, shared_weights
from runtime.kv_cache import KVCache

log = logging.getLogger("pyhlo")

SAVE_FORMAT = 1


def preferred_weight_layout(dtype: str, batch_size: int) -> str:
    """The weight layout whose matrix-vector products stream fastest on XLA:CPU.

    Without pyhlo's CPU kernels (see use_cpu_kernels), measured: f32 runs best with
    [in, out] at every batch size; bf16 and f16 at batch 1 only with [out, in].
    """
    return "out_in" if dtype in ("bf16", "f16") and batch_size == 1 else "in_out"


def use_cpu_kernels(neuron_config: NeuronConfig, backend: Any, dtype: str) -> bool:
    """Whether decode steps run on pyhlo's CPU kernels (matrix-vector products, attention).

    NeuronConfig.cpu_kernels None (the default) turns it on where it can run: XLA:CPU,
    f32 or bf16 weights, [out, in] layout (the default), a C++ compiler to build it, and
    PYHLO_CPU_KERNELS not 0. True insists (an error says what is missing); False is off.
    """
    wanted = neuron_config.cpu_kernels
    if wanted is False:
        return False
    reasons = []
    if getattr(backend, "platform", None) != "cpu":
        reasons.append(f"the backend is {backend!r}, not XLA:CPU")
    if dtype not in ("f32", "bf16"):
        reasons.append(f"amp {dtype} (the kernel reads f32 or bf16 weights)")
    if neuron_config.weight_layout == "in_out":
        reasons.append("weight_layout='in_out' (the kernel reads [out, in] weights)")
    if not reasons:
        from runtime import cpu_kernels

        if not cpu_kernels.register():
            reasons.append("the kernels are off (PYHLO_CPU_KERNELS=0, or they did not build: see the warning)")
    if reasons and wanted:
        raise ValueError("NeuronConfig.cpu_kernels=True, but " + "; ".join(reasons))
    return not reasons


class DecoderForSampling:
    family: DecoderFamily

    def __init__(self, checkpoint_path: str | os.PathLike, batch_size: int = 1,
                 n_positions: int | list[int] = 2048, tp_degree: int = 1, amp: str = "f32",
                 context_length_estimate: int | list[int] | None = None,
                 neuron_config: NeuronConfig | None = None, backend: Any = None):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if tp_degree != 1:
            raise NotSupportedYet(f"tp_degree={tp_degree} is not supported yet; use tp_degree=1")
        self.dtype = element_type_of_amp(amp)
        self.amp = amp
        self.neuron_config = neuron_config or NeuronConfig()
        self.checkpoint_path = pathlib.Path(checkpoint_path)
        self.checkpoint = open_checkpoint(checkpoint_path)
        self.config = self.checkpoint.config
        self._check_family(self.config)
        self.dims = dims_from_config(self.config)
        self.batch_size = batch_size
        self.token_buckets = bucketing.token_buckets(n_positions)
        self.context_buckets = bucketing.context_buckets(self.token_buckets, context_length_estimate)
        self.n_positions = self.token_buckets[-1]
        if backend is None:
            from runtime.backend import get_backend

            backend = get_backend()
        self.graph = self._graph_builder(backend)
        # Decode steps as one unrolled program: measured on XLA:CPU with the kernels, it
        # saves the launch of 30 block programs (about 37 us each), 2-4 ms of a 17-25 ms
        # step. Prefill, bound by arithmetic, stays per block (smaller code, faster start).
        whole = self.neuron_config.whole_model_program
        self.whole_model = self.graph.cpu_kernels if whole is None else whole
        self.programs = ProgramSet(self.graph, backend=backend,
                                   workers=self.neuron_config.compilation_worker_count)
        self.tp_degree = tp_degree
        self._weights: list[dict[str, Any]] | None = None
        self._shared: dict[str, Any] | None = None
        self.kv_cache: KVCache | None = None
        self._tokenizer = None

    def _graph_builder(self, backend: Any) -> GraphBuilder:
        kernel = use_cpu_kernels(self.neuron_config, backend, self.dtype)
        layout = "out_in" if kernel else (self.neuron_config.weight_layout
                                          or preferred_weight_layout(self.dtype, self.batch_size))
        head_dtype = self.dtype if kernel else "f32"
        return GraphBuilder(self.family, self.dims, self.batch_size, self.n_positions, self.dtype, layout,
                            head_dtype=head_dtype, cpu_kernels=kernel)

    # -- construction ------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, batch_size: int = 1,
                        n_positions: int | list[int] = 2048, tp_degree: int = 1, amp: str = "f32",
                        context_length_estimate: int | list[int] | None = None,
                        neuron_config: NeuronConfig | None = None, **kwargs: Any):
        """Open a checkpoint (HF directory or .gguf). Nothing is compiled until to_neuron()."""
        return cls(path, batch_size=batch_size, n_positions=n_positions, tp_degree=tp_degree,
                   amp=amp, context_length_estimate=context_length_estimate,
                   neuron_config=neuron_config, **kwargs)

    def _check_family(self, config: dict) -> None:
        model_type = config.get("model_type")
        if model_type not in self.family.model_types:
            raise ValueError(
                f"{type(self).__name__} runs {', '.join(self.family.model_types)} checkpoints; "
                f"{self.checkpoint_path} is model_type {model_type!r}"
            )
        for flag in ("attention_bias", "mlp_bias"):
            if config.get(flag):
                raise NotSupportedYet(f"{flag}=True checkpoints are not supported yet")

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = self.checkpoint.tokenizer()
        return self._tokenizer

    # -- to_neuron ---------------------------------------------------------------
    def decode_buckets(self) -> list[int]:
        """The cache lengths decode programs are built for: every token bucket, or just
        n_positions when the decode attention kernel reads only the filled slots anyway."""
        return [self.n_positions] if self.graph.cpu_kernels else self.token_buckets

    def eager_programs(self) -> list[tuple[str, tuple]]:
        """The programs to_neuron() compiles: prefill per context bucket (embed, one block
        program for every layer, LM head), decode per decode bucket (the whole model in one
        program, or the same three pieces), and the sampler."""
        keys: list[tuple[str, tuple]] = [("greedy", ())]
        if self.whole_model:
            keys += [("model_step", (1, s)) for s in self.decode_buckets()]
        else:
            keys += [("embed", (1,)), ("lm_head", (1,))] + [("block", (1, s)) for s in self.decode_buckets()]
        for c in self.context_buckets:
            keys += [("embed", (c,)), ("block", (c, c)), ("lm_head", (c,))]
        return keys

    def to_neuron(self) -> DecoderForSampling:
        """Build and compile every bucket's programs, then place weights and KV caches."""
        started = time.perf_counter()
        self.programs.compile_all(self.eager_programs())
        compiled = time.perf_counter()
        self._load_weights()
        log.info("to_neuron: compile %.1f s (%d from cache), weights %.1f s",
                 compiled - started, self.programs.cache_hits, time.perf_counter() - compiled)
        return self

    def _load_weights(self) -> None:
        from tqdm.auto import tqdm

        backend = self.programs.backend
        layout = self.graph.weight_layout
        shared = shared_weights(self.checkpoint, self.family, self.dims, self.dtype, layout,
                                self.graph.head_dtype)
        self._shared = {name: backend.to_device(array) for name, array in shared.items() if array is not None}
        del shared
        layers = iter_layers(self.checkpoint, self.family, self.dims, self.dtype, layout)
        self._weights = [
            {name: backend.to_device(array) for name, array in layer.items()}
            for layer in tqdm(layers, total=self.dims.n_layers, desc="loading weights", unit="layer",
                              disable=None)
        ]
        # The weights live on the device now: drop the checkpoint's file mapping, whose
        # pages would otherwise stay in this process's resident memory.
        self.checkpoint.close()
        cache_spec = self.graph.cache_spec("cache")
        self.kv_cache = KVCache(backend, self.dims.n_layers, cache_spec.dims, self.dtype)

    def _require_loaded(self) -> None:
        if self._weights is None:
            raise RuntimeError("call model.to_neuron() before sample()")

    # -- sampling ----------------------------------------------------------------
    def sample(self, input_ids: Any, sequence_length: int, start_ids: Any = None, top_k: int | list = 50,
               top_p: float | list = 1.0, temperature: float | list = 1.0,
               eos_token_id: int | list[int] | None = None, streamer: Any = None,
               stopping_criteria_list: Any = None, no_repeat_ngram_size: int | None = None,
               seed: int | None = None, attention_mask: Any = None, output_scores: bool = False):
        """Generate up to `sequence_length` tokens per line (prompt included).

        Returns a torch LongTensor [batch, <= sequence_length]: each line is its prompt
        followed by its new tokens, right-padded with the EOS id where lines end early.
        """
        import torch

        self._require_loaded()
        if start_ids is not None:
            raise NotSupportedYet("start_ids (continuous batching) is not supported yet")
        prompts = parse_prompts(input_ids, attention_mask, self.dims.vocab_size)
        if prompts.batch_size != self.batch_size:
            raise ValueError(
                f"got {prompts.batch_size} prompts but the model was compiled for batch_size={self.batch_size}"
            )
        if not isinstance(sequence_length, int) or sequence_length < 1:
            raise ValueError(f"sequence_length must be a positive int, got {sequence_length!r}")
        if sequence_length > self.n_positions:
            raise ValueError(
                f"sequence_length {sequence_length} exceeds n_positions {self.n_positions}; "
                "rebuild the model with a larger n_positions"
            )
        if prompts.longest > sequence_length:
            raise ValueError(
                f"prompt length {prompts.longest} exceeds sequence_length {sequence_length}"
            )
        top_ks = per_line(top_k, self.batch_size, "top_k")
        top_ps = per_line(top_p, self.batch_size, "top_p")
        temperatures = per_line(temperature, self.batch_size, "temperature")
        check_sampling(top_ks, top_ps, temperatures)
        if no_repeat_ngram_size is not None and (not isinstance(no_repeat_ngram_size, int)
                                                 or no_repeat_ngram_size < 1):
            raise ValueError(f"no_repeat_ngram_size must be an int >= 1, got {no_repeat_ngram_size!r}")
        eos_ids = self._eos_ids(eos_token_id)

        from decoders.generation import Generation

        generation = Generation(self, prompts, top_ks, top_ps, temperatures, seed, no_repeat_ngram_size)
        if output_scores:
            generation.scores = []
        lines = generation.run(sequence_length, eos_ids, streamer, stopping_criteria_list)
        pad = eos_ids[0] if eos_ids else 0
        width = max(len(line) for line in lines)
        out = torch.full((self.batch_size, width), pad, dtype=torch.long)
        for i, line in enumerate(lines):
            out[i, : len(line)] = torch.tensor(line, dtype=torch.long)
        if output_scores:
            return out, [torch.from_numpy(s) for s in generation.scores]
        return out

    def _eos_ids(self, eos_token_id: Any) -> list[int]:
        ids = eos_token_id if eos_token_id is not None else self.dims.eos_token_id
        if ids is None:
            return []
        return [int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])]

    def generation_config(self) -> GenerationConfig | None:
        return self.neuron_config.on_device_generation

    # -- save / load -------------------------------------------------------------
    def describe(self) -> dict:
        return {
            "format": SAVE_FORMAT, "class": type(self).__name__, "amp": self.amp,
            "batch_size": self.batch_size, "n_positions": self.token_buckets,
            "context_length_estimate": self.context_buckets,
            "neuron_config": self.neuron_config.to_dict(),
        }

    def save(self, directory: str | os.PathLike) -> None:
        """Write every compiled program and the configuration to `directory`."""
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.programs.save(directory)
        (directory / "pyhlo_model.json").write_text(json.dumps(self.describe(), indent=2))

    def load(self, directory: str | os.PathLike) -> DecoderForSampling:
        """Use the programs saved by save(); to_neuron() then compiles nothing."""
        directory = pathlib.Path(directory)
        manifest = directory / "pyhlo_model.json"
        if not manifest.exists():
            raise ValueError(f"{directory} has no pyhlo_model.json: it was not written by model.save()")
        saved = json.loads(manifest.read_text())
        mine = self.describe()
        for key in ("class", "amp", "batch_size", "n_positions"):
            if saved.get(key) != mine[key]:
                raise ValueError(f"{directory} was saved with {key}={saved.get(key)!r}, this model has {mine[key]!r}")
        self.programs.load(directory)
        return self

    # -- used by Generation ------------------------------------------------------
    def program(self, kind: str, *args: int) -> Program:
        return self.programs.get(kind, args)
