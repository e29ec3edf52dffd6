"""DecoderForSampling: from_pretrained -> to_neuron -> sample / forward, for every family.

A family subclass only names its `Family` description (families/). The model reads the
checkpoint's config into pieces (blocks/), decides once how tensor parallelism shares out
keys and values (parallel/kv_sharding.py) and which lowering runs on the platform
(platform_choice.py), and hands pieces and lowering to a Session (session/) that owns the
compiled programs, the weights and the KV caches. sample() and forward() are thin clients
of that Session.
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import pathlib
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from decoders.checkpoints import open_checkpoint
from decoders.checkpoints.gguf_forms import gguf_block_forms
from decoders.config import GenerationConfig, NeuronConfig, NotSupportedYet
from decoders.description import ConfigReader, Family
from decoders.lowering import XlaLowering
from decoders.parallel import kv_sharding
from decoders.platform_choice import choose_lowering
from decoders.programs import buckets as bucketing
from decoders.programs.builder import ProgramBuilder
from decoders.programs.keys import ProgramKey
from decoders.programs.memory import check_fits, planned_memory
from decoders.saved_directory import check_replaceable, read_description, write_description
from decoders.session.generation import Generation, sampler_bound
from decoders.session.inputs import check_sampling, parse_prompts, per_line
from decoders.session.lines import run_sequences
from decoders.session.session import Session
from decoders.weights.stored import BLOCK_FORMS
from pyhlo.dtypes import element_type_of_amp
from runtime.atomic_directory import replaced_directory

log = logging.getLogger("pyhlo")

SAVE_FORMAT = 3
# transformers-neuronx's n_positions when the caller gives none (lowered to what a learned
# position table holds).
DEFAULT_N_POSITIONS = 2048
# sample()'s top_k when neither the call nor NeuronConfig.on_device_generation gives one (HF's).
DEFAULT_TOP_K = 50
# What sample() imports: to_neuron() imports it beside the compiles, so that the first call
# does not pay for it (torch: 1 to 2 s on 2 cores, several more when its files left the page cache).
SAMPLE_IMPORTS = ("torch",)


class DecoderForSampling:
    family: Family

    def __init__(self, checkpoint_path: str | os.PathLike, batch_size: int = 1,
                 n_positions: int | list[int] | None = None, tp_degree: int = 1, amp: str = "f32",
                 context_length_estimate: int | list[int] | None = None,
                 neuron_config: NeuronConfig | None = None, backend: Any = None):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if not isinstance(tp_degree, int) or tp_degree < 1:
            raise ValueError(f"tp_degree must be an int >= 1, got {tp_degree!r}")
        self.tp_degree = tp_degree
        self.dtype = element_type_of_amp(amp)
        self.amp = amp
        self.neuron_config = neuron_config or NeuronConfig()
        if self.neuron_config.quant is not None:
            self.neuron_config.quant.check_amp(self.dtype)
        self.checkpoint_path = pathlib.Path(checkpoint_path)
        self.checkpoint = open_checkpoint(checkpoint_path)
        self.config = self.checkpoint.config
        self._check_family(self.config)
        self.decoder = self.family.describe(ConfigReader(self.config, self.family.name),
                                            self.neuron_config.fuse_qkv)
        self.batch_size = batch_size
        self.token_buckets = bucketing.token_buckets(self._n_positions_or_default(n_positions))
        self.context_buckets = bucketing.context_buckets(self.token_buckets, context_length_estimate)
        self.n_positions = self.token_buckets[-1]
        self.decoder = self.decoder.for_context(self.n_positions)
        self._check_position_table()
        if backend is None:
            from runtime import get_backend

            backend = get_backend()
        kv = kv_sharding.decide(self.decoder.layer.attention, tp_degree=tp_degree,
                                strategy=self.neuron_config.group_query_attention,
                                over_sequence=self.neuron_config.shard_over_sequence)
        lowering = choose_lowering(self.neuron_config, backend, dtype=self.dtype, batch_size=batch_size,
                                   tp_degree=tp_degree, kv_sharding=kv,
                                   gguf_blocks=self._gguf_blocks(tp_degree))
        builder = ProgramBuilder(self.decoder, batch_size, self.n_positions + self._scratch_slots(), lowering,
                                 per_line_slots=self.continuous_batching)
        builder.check_sharding()                 # heads or rows that do not split fail here, naming the fix
        self.session = Session(builder, backend, self.token_buckets, self.context_buckets,
                               workers=self.neuron_config.compilation_worker_count)
        # Before anything is compiled or placed: a request the machine cannot hold fails now.
        check_fits(planned_memory(builder), replicas=len(self.session.placement.local), backend=backend)
        self._tokenizer = None
        # A directory of presharded weights chosen by load(): to_neuron() places those instead.
        self._presharded: pathlib.Path | None = None
        # The on-device generation settings sample() uses now (update_generation_config changes them).
        self._on_device: GenerationConfig | None = None
        if self.neuron_config.on_device_generation is not None:
            self._on_device = self._checked_generation(self.neuron_config.on_device_generation)
            self.session.sampler_k_max = self._on_device_bound(self._on_device)
        else:
            # The sampler of sample()'s default top_k, compiled by to_neuron() rather than by the
            # first call that samples (a smaller top_k runs the same program).
            self.session.sampler_k_max = sampler_bound([DEFAULT_TOP_K], self.decoder.head.vocab_size)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, batch_size: int = 1,
                        n_positions: int | list[int] | None = None, tp_degree: int = 1, amp: str = "f32",
                        context_length_estimate: int | list[int] | None = None,
                        neuron_config: NeuronConfig | None = None, **kwargs: Any):
        """Open a checkpoint (HF directory or .gguf). Nothing is compiled until to_neuron()."""
        return cls(path, batch_size=batch_size, n_positions=n_positions, tp_degree=tp_degree,
                   amp=amp, context_length_estimate=context_length_estimate,
                   neuron_config=neuron_config, **kwargs)

    @property
    def continuous_batching(self) -> bool:
        return self.neuron_config.continuous_batching is not None

    def _scratch_slots(self) -> int:
        """Cache slots past n_positions under continuous batching: a line writes a whole chunk
        (a context bucket) from its own length, or, when it has no part in a step, there."""
        cb = self.neuron_config.continuous_batching
        if cb is None:
            return 0
        if cb.batch_size_for_shared_caches != self.batch_size:
            raise ValueError(f"ContinuousBatchingConfig(batch_size_for_shared_caches="
                             f"{cb.batch_size_for_shared_caches}) must equal batch_size={self.batch_size}: "
                             f"each batch line holds one sequence")
        return self.context_buckets[-1]

    def _check_family(self, config: dict) -> None:
        model_type = config.get("model_type")
        if model_type not in self.family.model_types:
            raise ValueError(
                f"{type(self).__name__} runs {', '.join(self.family.model_types)} checkpoints; "
                f"{self.checkpoint_path} is model_type {model_type!r}"
            )

    def _gguf_blocks(self, tp_degree: int) -> tuple[tuple[str, str], ...]:
        """The weights that run in the GGUF file's own blocks (NeuronConfig.gguf_blocks)."""
        wanted = self.neuron_config.gguf_blocks
        if wanted is False or (wanted is None and (tp_degree > 1 or self.neuron_config.quant is not None)):
            return ()
        if tp_degree > 1:
            raise ValueError("NeuronConfig.gguf_blocks=True runs at tp_degree 1 only (blocks are not split "
                             "over devices yet); use gguf_blocks=None to widen them at load under tensor "
                             "parallelism")
        forms = gguf_block_forms(self.checkpoint, self.decoder.layer.params(), self.decoder.head.params(),
                                 self.decoder.n_layers, self.dtype)
        if wanted and not forms:
            kept = ", ".join(form.ggml_type for form in BLOCK_FORMS.values())
            raise ValueError(f"NeuronConfig.gguf_blocks=True, but {self.checkpoint_path} stores no linear "
                             f"weight in a GGUF block form pyhlo runs as stored ({kept})")
        return tuple(sorted(forms.items()))

    def _n_positions_or_default(self, n_positions: int | list[int] | None) -> int | list[int]:
        """n_positions as asked; when not asked, transformers-neuronx's 2048, or as many positions
        as a learned position table holds if fewer (asking for more stays an error)."""
        if n_positions is not None:
            return n_positions
        rows = self._position_rows()
        if rows is None or rows >= DEFAULT_N_POSITIONS:
            return DEFAULT_N_POSITIONS
        log.info("n_positions %d: the most the checkpoint's learned position table (%s) holds "
                 "(transformers-neuronx's default is %d)", rows, self.decoder.embedding.positions,
                 DEFAULT_N_POSITIONS)
        return rows

    def _position_rows(self) -> int | None:
        """How many positions the checkpoint's learned position table holds (None: no table)."""
        embedding = self.decoder.embedding
        if embedding.positions is None:
            return None
        return embedding.n_positions - embedding.position_offset

    def _check_position_table(self) -> None:
        """A learned position table must hold every position a sequence can reach."""
        rows = self._position_rows()
        if rows is not None and self.n_positions > rows:
            raise ValueError(f"n_positions {self.n_positions} exceeds the {rows} positions of the "
                             f"checkpoint's learned position table ({self.decoder.embedding.positions}); "
                             f"use n_positions <= {rows}")

    # -- what was built ------------------------------------------------------------
    @property
    def lowering(self) -> XlaLowering:
        return self.session.lowering

    @property
    def programs(self):
        return self.session.programs

    @property
    def kv_cache(self):
        return self.session.kv_cache

    def decode_buckets(self) -> list[int]:
        return self.session.decode_buckets()

    def eager_programs(self) -> list[ProgramKey]:
        return self.session.eager_programs()

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = self.checkpoint.tokenizer()
        return self._tokenizer

    # -- to_neuron ---------------------------------------------------------------
    def to_neuron(self) -> DecoderForSampling:
        """Build and compile every bucket's programs, and meanwhile place weights and KV caches
        and import what sample() imports: the first sample() then has nothing left to do lazily."""
        started = time.perf_counter()

        def place_weights() -> float:
            self.session.load_weights(self.checkpoint, presharded=self._presharded)
            return time.perf_counter() - started

        def import_for_sample() -> float:
            for name in SAMPLE_IMPORTS:
                importlib.import_module(name)
            return time.perf_counter() - started

        # The weights are placed while the programs are built, compiled or loaded from the
        # cache: building is Python, reading and placing mostly not, so each fills the other's
        # waits; what sample() imports comes in meanwhile too.
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="pyhlo-weights") as pool:
            placing = pool.submit(place_weights)
            importing = pool.submit(import_for_sample)
            self.session.compile()
            compiled = time.perf_counter() - started
            placed = placing.result()
            imported = importing.result()
        # The weights live on the device now: forget the checkpoint's file mapping (the
        # mapped pages the device uses in place stay, as its buffers).
        self.checkpoint.close()
        log.info("to_neuron: compile %.2f s (%d from cache), weights %.2f s, imports %.2f s, side by side",
                 compiled, self.programs.cache_hits, placed, imported)
        return self

    def _require_loaded(self) -> None:
        if not self.session.loaded:
            raise RuntimeError("call model.to_neuron() before sample() or forward()")

    def enable_speculative_decoder(self, speculation_length: int) -> None:
        """As transformers-neuronx: build the program that checks `speculation_length` draft
        tokens (and the token before them) in one call, for SpeculativeGenerator. Call it
        before to_neuron(), which then compiles that program too."""
        if not isinstance(speculation_length, int) or speculation_length < 1:
            raise ValueError(f"speculation_length must be an int >= 1, got {speculation_length!r}")
        if speculation_length + 1 > self.n_positions:
            raise ValueError(f"speculation_length {speculation_length} does not fit n_positions "
                             f"{self.n_positions}")
        self.session.speculation_length = speculation_length

    # -- forward -----------------------------------------------------------------
    def forward(self, input_ids: Any, cache_ids: Any = None, start_ids: Any = None):
        """Run input_ids [batch, n] through the model; f32 logits [batch, vocab] of the last token.

        cache_ids: the cache positions of the n tokens (contiguous, the same for every line;
        default 0..n-1, a new sequence). start_ids: per line, the offset of its first real
        token in a left-padded batch (default 0). Keys and values stay in the KV cache for
        the next call, as in transformers-neuronx.

        Under continuous batching, as transformers-neuronx has it: input_ids [k, n] are k
        sequences' next tokens, start_ids their batch lines (seq_ids), cache_ids [k, n] their
        positions (each row its own); logits [k, vocab], rows in that order
        (decoders/session/lines.py).
        """
        import torch

        self._require_loaded()
        ids = parse_prompts(input_ids, vocab_size=self.decoder.head.vocab_size).as_given().astype(np.int32)
        if self.continuous_batching:
            return torch.from_numpy(run_sequences(self.session, ids, cache_ids, start_ids))
        if ids.shape[0] != self.batch_size:
            raise ValueError(f"input_ids has {ids.shape[0]} lines; the model was compiled for "
                             f"batch_size={self.batch_size}")
        slot = self._first_slot(cache_ids, ids.shape[1])
        pads = np.zeros(self.batch_size, np.int32)
        if start_ids is not None:
            pads = np.asarray(per_line(np.asarray(start_ids).reshape(-1).tolist(), self.batch_size,
                                       "start_ids"),
                              np.int32)
        logits = self.session.run_batch(ids, slot, pads)
        return torch.from_numpy(self.session.host_logits(logits))

    def _first_slot(self, cache_ids: Any, n_tokens: int) -> int:
        if cache_ids is None:
            return 0
        ids = np.asarray(cache_ids.tolist() if hasattr(cache_ids, "tolist") else cache_ids, np.int64)
        if ids.ndim == 2:
            if not (ids == ids[:1]).all():
                raise NotSupportedYet("cache_ids that differ between batch lines (continuous batching) "
                                      "are not supported yet")
            ids = ids[0]
        if ids.shape != (n_tokens,) or not np.array_equal(ids, ids[0] + np.arange(n_tokens)):
            raise ValueError(f"cache_ids must be {n_tokens} consecutive cache positions, got {ids.tolist()}")
        return int(ids[0])

    # -- on-device generation settings -------------------------------------------
    def _checked_generation(self, config: GenerationConfig) -> GenerationConfig:
        """A copy of `config`, its per-line settings checked against the batch size."""
        NeuronConfig._check_generation(config)
        config = dataclasses.replace(config)
        if config.per_batch_line:
            for name in ("top_k", "top_p", "temperature"):
                setattr(config, name,
                        per_line(getattr(config, name), self.batch_size, f"GenerationConfig.{name}"))
        return config

    def _top_ks(self, config: GenerationConfig) -> list[int]:
        """Per line, the top_k sample() runs by default: 1 without do_sample; 0 (no filter) is
        the whole vocabulary, or global_top_k when that bounds the candidates."""
        if not config.do_sample:
            return [1] * self.batch_size
        everything = config.global_top_k or self.decoder.head.vocab_size
        return [int(k) or everything for k in per_line(config.top_k, self.batch_size, "top_k")]

    def _on_device_bound(self, config: GenerationConfig) -> int:
        """The sampler compiled with the model: global_top_k, else a bound for the configured top_k
        (later settings up to it need no compiler call; a larger top_k compiles a larger sampler)."""
        vocab = self.decoder.head.vocab_size
        if config.global_top_k:
            return min(vocab, config.global_top_k)
        wanted = max(self._top_ks(dataclasses.replace(config, do_sample=True)))
        return sampler_bound([max(wanted, 2)], vocab)

    def update_generation_config(self, generation_config: GenerationConfig) -> None:
        """Change the on-device generation settings (max_length, do_sample, top_k, top_p,
        temperature, eos_token_id) for later sample() calls, as transformers-neuronx does: they are inputs of
        the compiled sampler, so nothing is compiled. per_batch_line and global_top_k are fixed
        when the model is built (a global_top_k of None keeps the built one)."""
        if self._on_device is None:
            raise ValueError("update_generation_config() changes NeuronConfig.on_device_generation: build "
                             "the model with NeuronConfig(on_device_generation=GenerationConfig(...)) first")
        current = self._on_device
        if generation_config.per_batch_line != current.per_batch_line:
            raise ValueError("the new GenerationConfig has "
                             f"per_batch_line={generation_config.per_batch_line}, the model was built with "
                             f"per_batch_line={current.per_batch_line}")
        if generation_config.global_top_k is None:
            generation_config = dataclasses.replace(generation_config, global_top_k=current.global_top_k)
        elif generation_config.global_top_k != current.global_top_k:
            raise ValueError(f"global_top_k is fixed when the model is built ({current.global_top_k}); "
                             f"got {generation_config.global_top_k}")
        self._on_device = self._checked_generation(generation_config)

    # -- sampling ----------------------------------------------------------------
    def sample(self, input_ids: Any, sequence_length: int, start_ids: Any = None,
               top_k: int | list | None = None,
               top_p: float | list | None = None, temperature: float | list | None = None,
               eos_token_id: int | list[int] | None = None, streamer: Any = None,
               stopping_criteria_list: Any = None, no_repeat_ngram_size: int | None = None,
               seed: int | None = None, attention_mask: Any = None, output_scores: bool = False):
        """Generate until each line is `sequence_length` long (prompt included), or the on-device
        GenerationConfig.max_length where that is smaller.

        input_ids: a [batch, length] tensor, padded and marked by `attention_mask` or
        `start_ids` (offset of each line's first real token); the result is [batch,
        <= sequence_length], each line its input row as given, then its new tokens. Or a list
        of prompts of different lengths: each line its prompt, then its new tokens. Lines
        that end early are right-padded with the EOS id. top_k, top_p and temperature default
        to the on-device generation settings (NeuronConfig.on_device_generation, changed by
        update_generation_config), else DEFAULT_TOP_K (50), 1.0 and 1.0.
        """
        import torch

        self._require_loaded()
        prompts = parse_prompts(input_ids, attention_mask, self.decoder.head.vocab_size, start_ids)
        if prompts.batch_size != self.batch_size:
            raise ValueError(
                f"got {prompts.batch_size} prompts but the model was compiled for "
                f"batch_size={self.batch_size}"
            )
        if not isinstance(sequence_length, int) or sequence_length < 1:
            raise ValueError(f"sequence_length must be a positive int, got {sequence_length!r}")
        max_length = self._on_device.max_length if self._on_device is not None else None
        if max_length is not None and max_length < sequence_length:
            sequence_length = max_length        # as transformers-neuronx: the smaller of the two
        if sequence_length > self.n_positions:
            raise ValueError(
                f"sequence_length {sequence_length} exceeds n_positions {self.n_positions}; "
                "rebuild the model with a larger n_positions"
            )
        if prompts.width > sequence_length:
            bound = "GenerationConfig.max_length" if sequence_length == max_length else "sequence_length"
            raise ValueError(f"prompt length {prompts.width} exceeds {bound} {sequence_length}")
        on_device = self._on_device
        configured = on_device or GenerationConfig()
        if top_k is None:
            top_k = self._top_ks(on_device) if on_device is not None else DEFAULT_TOP_K
        top_ks = per_line(top_k, self.batch_size, "top_k")
        top_ps = per_line(configured.top_p if top_p is None else top_p, self.batch_size, "top_p")
        temperatures = per_line(configured.temperature if temperature is None else temperature,
                                self.batch_size, "temperature")
        check_sampling(top_ks, top_ps, temperatures)
        if no_repeat_ngram_size is not None and (not isinstance(no_repeat_ngram_size, int)
                                                 or no_repeat_ngram_size < 1):
            raise ValueError(f"no_repeat_ngram_size must be an int >= 1, got {no_repeat_ngram_size!r}")
        eos_ids = self.eos_ids(eos_token_id if eos_token_id is not None else configured.eos_token_id)
        k_max = sampler_bound(top_ks, self.decoder.head.vocab_size, configured.global_top_k,
                              self.session.sampler_k_max)
        generation = Generation(self.session, prompts, top_ks, top_ps, temperatures, seed,
                                no_repeat_ngram_size, k_max=k_max, output_scores=output_scores)
        new_tokens = generation.run(sequence_length - prompts.width, eos_ids, streamer,
                                    stopping_criteria_list)
        out = torch.from_numpy(prompts.layout(new_tokens, eos_ids[0] if eos_ids else 0))
        if output_scores:
            return out, [torch.from_numpy(s) for s in generation.scores]
        return out

    def eos_ids(self, eos_token_id: Any = None) -> list[int]:
        """The end-of-sequence ids: the given id(s), else the checkpoint config's."""
        ids = eos_token_id if eos_token_id is not None else self.config.get("eos_token_id")
        if ids is None:
            return []
        return [int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])]

    # -- save / load -------------------------------------------------------------
    def saved_settings(self) -> dict:
        """The settings save() writes beside the programs (pyhlo_model.json) and load() checks."""
        return {
            "format": SAVE_FORMAT, "class": type(self).__name__, "amp": self.amp,
            "batch_size": self.batch_size, "n_positions": self.token_buckets, "tp_degree": self.tp_degree,
            "context_length_estimate": self.context_buckets,
            "neuron_config": self.neuron_config.to_dict(),
        }

    def save(self, directory: str | os.PathLike, sharded_weights: bool = False) -> None:
        """Write every compiled program and the configuration to `directory`. sharded_weights:
        also each replica's weights as it holds them (directory/weights/rank{r}.safetensors),
        which load() then places with no checkpoint reading and no sharding.

        Everything is written into a new directory beside `directory` and renamed into place,
        the description (with each file's size, and the programs' hashes) last: a kill at any
        moment leaves the earlier save or none, never a mix. Across several processes each
        writes its own replicas' files into `directory` itself (no one process can swap in
        the whole)."""
        directory = pathlib.Path(directory)
        if self.session.placement.local != list(range(self.tp_degree)):
            directory.mkdir(parents=True, exist_ok=True)
            self._write_saved(directory, sharded_weights, list_files=False)
            return
        check_replaceable(directory)
        with replaced_directory(directory) as staging:
            self._write_saved(staging, sharded_weights, list_files=True)

    def _write_saved(self, directory: pathlib.Path, sharded_weights: bool, list_files: bool) -> None:
        self.programs.save(directory)
        description = self.saved_settings()
        if sharded_weights:
            description["sharded_weights"] = {**self.session.save_weights(directory), "amp": self.amp}
        write_description(directory, description, list_files=list_files)

    def load(self, directory: str | os.PathLike) -> DecoderForSampling:
        """Use the programs saved by save(), and its presharded weights if it wrote them;
        to_neuron() then compiles nothing."""
        directory = pathlib.Path(directory)
        saved = read_description(directory)
        mine = self.saved_settings()
        for key in ("class", "amp", "batch_size", "n_positions", "tp_degree"):
            if saved.get(key) != mine[key]:
                raise ValueError(f"{directory} was saved with {key}={saved.get(key)!r}, this model has "
                                 f"{mine[key]!r}")
        weights = saved.get("sharded_weights")
        if weights is not None:             # amp and tp_degree were checked above with the programs
            self.session.check_presharded(directory, weights)
        self.programs.load(directory)
        self._presharded = directory if weights is not None else None
        return self

