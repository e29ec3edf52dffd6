"""Session: the compiled programs, the weights and the KV caches of one model on its device,
and the ways to run the model over them, each named for what its caller means:

    session.run_batch(token_ids, slot=s, pads=p)   # logits (on the device) of each line's last token
    session.host_logits(logits)                    # as numpy [batch, vocab], only when asked

`run_batch` runs the whole batch as one sequence per line, every line at the same cache
slots: it writes the tokens' keys and values at slots s .. s + n - 1 of every line (lines
are left-padded: line i's real tokens start at slot pads[i]) and picks the programs: one
token per line is a decode step (the whole model in one program, or embed, a block program
per layer and the LM head), more is prefill in context-bucket chunks. `decode` is its decode
step with the greedy tokens the program makes, and `check_drafts` gives every position's
logits (speculative decoding's check of draft tokens). sample(), the model's forward() and an
HF generate() adapter are clients of them.

Under continuous batching (builder.per_line_slots) every line is its own sequence at its
own length:
    step_every_line(token_ids, slots, last_index)   # every line's chunk or newest token, one program
    prefill_line(token_ids, line, slot, last_index)  # one line's prompt chunk, that line alone
    prefill_lines(token_ids, lines, slots, last_index)   # a chunk for each of a few lines, one program
    decode_lines(token_ids, lines, slots)            # one token for each of a few lines
A chunk runs from each line's length into the scratch slots past n_positions (tokens past a
line's last index are padding: written beyond its length, never attended, overwritten by its
next tokens); a line with no part in a step writes at n_positions.
"""
from __future__ import annotations

import logging
import pathlib
from dataclasses import replace
from typing import Any

import numpy as np

from decoders.blocks.params import read
from decoders.programs import buckets as bucketing
from decoders.programs.builder import ProgramBuilder, layer_prefix
from decoders.programs.compiled import ProgramSet
from decoders.programs.keys import (
    Block,
    CopyLine,
    Embed,
    Greedy,
    LMHead,
    LMHeadAll,
    ModelStep,
    ProgramKey,
    Sampler,
)
from decoders.session import presharded as preshards
from pyhlo.dtypes import numpy_dtype
from runtime.kv_cache import KVCache
from runtime.placement import Placement, Replicas

log = logging.getLogger("pyhlo")

# Prompt chunks of context buckets up to this many tokens (a chat prompt's, or what is left of
# it past a kept prefix) are prefilled for several lines in one program, with programs
# compiled by to_neuron() (prefill_lines()). A narrow chunk costs about a pass over the
# weights (and, for GGUF blocks widened in the program, their widening), which one program
# over several lines pays once; a wide chunk already spreads that over many tokens, and every
# width adds a program per row count and attention bucket.
BATCHED_PREFILL_MAX_WIDTH = 64


class Session:
    """One model's state on its device and the only way to run programs over it.

    It owns the compiled programs (a ProgramSet, compiled by compile() or on first use), the
    weights placed on each replica (load_weights(), or presharded files), the KV caches and
    the small step inputs kept on the device between calls. It knows buckets, slots and
    lines, not requests: sample() / generate() (Generation), transformers-neuronx's forward()
    (lines.py), speculative decoding and the server's scheduler decide what to run, and call
    the entry points above.
    """

    def __init__(self, builder: ProgramBuilder, backend: Any, token_buckets: list[int],
                 context_buckets: list[int], workers: int | None = None):
        self.builder = builder
        self.backend = backend
        # One device, or one buffer per replica of the tensor-parallel programs.
        self.placement = Placement(backend, builder.tp_degree)
        self.programs = ProgramSet(builder, backend, workers)
        self.token_buckets = token_buckets
        self.context_buckets = context_buckets
        self.shared: dict[str, Any] | None = None
        self.layers: list[dict[str, Any]] | None = None
        self.kv_cache: KVCache | None = None
        self._pads: np.ndarray | None = None
        self._pad_buffer = None
        # A decode step's small inputs (positions, slot, last index) on the device, by value:
        # uploaded once, not at every token (a host-to-device copy costs about 0.3 ms); the
        # whole-model decode program hands over the next step's positions and slot itself.
        self._step_buffers: dict[tuple, Any] = {}
        # The unrolled decode program's names of each layer's weights and caches (load_weights()).
        self._prefixed_weights: dict[str, Any] = {}
        self._prefixed_cache_names: list[tuple[str, str]] = []
        # Speculative decoding (enable_speculative_decoder): the target checks this many draft
        # tokens, plus the token before them, in one program (check_drafts()).
        self.speculation_length: int | None = None
        # The sampler bound of sample()'s default or NeuronConfig.on_device_generation's top_k,
        # compiled with the rest so that neither the first sample() nor changing the on-device
        # settings later compiles anything (None: each sampler is built on first use).
        self.sampler_k_max: int | None = None

    @property
    def lowering(self):
        return self.builder.lowering

    @property
    def batch_size(self) -> int:
        return self.builder.batch_size

    @property
    def n_positions(self) -> int:
        return self.token_buckets[-1]

    @property
    def loaded(self) -> bool:
        return self.layers is not None

    # -- programs -----------------------------------------------------------------------
    def decode_buckets(self) -> list[int]:
        """The cache lengths decode programs are built for."""
        plain = all(kind.attention.plain for kind in self.builder.decoder.kinds)
        return self.lowering.decode_buckets(self.token_buckets, plain)

    def eager_programs(self) -> list[ProgramKey]:
        """What to_neuron() compiles: prefill per context bucket (embed, one block program for
        every layer, LM head), decode per decode bucket (the whole model in one program, or the
        same three pieces), the greedy sampler, and the sampler for sampler_k_max if set."""
        keys: list[ProgramKey] = [Greedy()]
        if self.sampler_k_max is not None:
            keys.append(Sampler(self.sampler_k_max))
        keys += self._decode_programs()
        for c in self.context_buckets:
            keys += [Embed(c), Block(c, c), LMHead(c)]
            if self.per_line:
                # A chunk joins lines at any length: it attends as far as the longest.
                keys += [Block(c, s) for s in self.token_buckets if s > c]
            if self.row_prefill:
                # A first chunk attends to its own width (prefill_line()), then to token buckets.
                attends = [c] + [s for s in self.token_buckets if s > c]
                for rows in self.prefill_rows(c):
                    keys += [Embed(c, rows), LMHead(c, rows)] + [Block(c, s, rows) for s in attends]
        for rows in self.decode_rows():
            keys += self._decode_programs(rows)
        if self.row_prefill:
            keys.append(CopyLine(self.context_buckets[0]))   # copy_line()'s window
        if self.speculation_length is not None:
            n = self.speculation_length + 1
            keys += [Embed(n), LMHeadAll(n)] + [Block(n, s) for s in self.token_buckets]
        # A block program for each kind of layer (Gemma's sliding-window and global layers).
        kinds = range(len(self.builder.decoder.kinds))
        return [replace(key, kind=kind) if isinstance(key, Block) else key for key in keys
                for kind in (kinds if isinstance(key, Block) else (0,))]

    def _decode_programs(self, rows: int | None = None) -> list[ProgramKey]:
        """A decode step's programs, over every line or `rows` of them, per decode bucket: the
        whole model in one program, or embed, one block program for every layer, LM head."""
        if self.lowering.whole_model_decode:
            return [ModelStep(1, s, rows) for s in self.decode_buckets()]
        return [Embed(1, rows), LMHead(1, rows)] + [Block(1, s, rows) for s in self.decode_buckets()]

    def _runs_whole_model(self, n_tokens: int, every_position: bool) -> bool:
        """Whether a step of n_tokens runs in _decode_programs()' one program for the whole model."""
        return self.lowering.whole_model_decode and n_tokens == 1 and not every_position

    @property
    def per_line(self) -> bool:
        """Continuous batching: each line writes at its own slot."""
        return self.builder.per_line_slots

    @property
    def row_prefill(self) -> bool:
        """Continuous batching with programs for one line (prefill_line()): a prompt is
        prefilled at the cost of its own tokens, not of a chunk for every line. Not where a
        line's cache is spread over the replicas (flash decoding, lines split by replica)."""
        whole_lines = self.builder.device_decoder.layer.attention.kv_sharding.whole_lines
        return self.per_line and self.batch_size > 1 and whole_lines

    def decode_rows(self) -> list[int]:
        """Continuous batching: the numbers of lines (powers of two below the batch size) that
        a decode step can run alone (decode_lines()), so that a step with few active lines
        does not compute a row for every line."""
        if not self.row_prefill:
            return []
        return [1 << i for i in range(self.batch_size.bit_length()) if 1 << i < self.batch_size]

    def batched_prefill_buckets(self) -> list[int]:
        """Continuous batching: the context buckets whose chunks prefill_lines() runs for several
        lines with programs to_neuron() compiles: those of at most BATCHED_PREFILL_MAX_WIDTH."""
        return [c for c in self.context_buckets if c <= BATCHED_PREFILL_MAX_WIDTH] if self.row_prefill else []

    def prefill_rows(self, n_tokens: int) -> list[int]:
        """The row counts of the programs to_neuron() compiles for prompt chunks of n_tokens (a
        context bucket) of some lines: one line (prefill_line()), and, for the narrowest chunks,
        decode_rows()' larger counts (prefill_lines(); more lines than those run the program
        over every line)."""
        if not self.row_prefill:
            return []
        if n_tokens not in self.batched_prefill_buckets():
            return [1]
        return self.decode_rows()

    def compile(self) -> None:
        self.programs.compile_all(self.eager_programs())

    def sampler(self, k_max: int | None) -> Any:
        """The greedy program (k_max None) or the top-k/top-p sampler for up to k_max candidates."""
        return self.programs.get(Greedy() if k_max is None else Sampler(k_max))

    # -- weights and caches ---------------------------------------------------------------
    def load_weights(self, checkpoint: Any, presharded: str | pathlib.Path | None = None) -> None:
        """Place every declared parameter on the device, one layer at a time: read from the
        checkpoint and arranged for each replica, or, given a directory save_weights() wrote
        (checked by check_presharded()), each replica's part read as it is from its own file.
        Across several processes each places only its own replicas' parts (placement.local)."""
        from tqdm.auto import tqdm

        lowering = self.lowering
        if presharded is not None:
            files = {r: preshards.RankFile(preshards.rank_file(presharded, r)) for r in self.placement.local}

            def place(param, layer):
                spec = self.builder.spec(param)
                name, dtype = preshards.tensor_name(param.name, layer), numpy_dtype(spec.dtype)
                return self.placement.put_parts(lambda rank: files[rank].read(name, dtype, spec.dims),
                                                streamed=True)
        else:
            last: dict = {}

            def place(param, layer):
                # Read (and quantized) once, then each kept replica's part, made as it is placed:
                # no process holds replica-sized copies of the whole weight, nor parts it does
                # not keep. A quantized weight's scales (and minimums) come from the weight just read.
                if param.part_of and last.get("key") == (param.part_of, layer):
                    prepared = last["prepared"]
                else:
                    prepared = lowering.prepare(param, read(param, checkpoint, layer))
                last.update(key=(param.part_of or param.name, layer), prepared=prepared)
                return self.placement.put_parts(lambda rank: lowering.arrange(param, prepared, rank),
                                                streamed=True)

        def release(placed: dict[str, Any]) -> None:
            # A mapped file's pages read for these weights, except those the device uses in
            # place: it holds its own copies of the others now.
            kept = set().union(*(self.placement.host_addresses(value) for value in placed.values()))
            for source in (files.values() if presharded is not None else (checkpoint,)):
                source.release_pages(kept)

        self.shared = {p.name: place(p, None) for p in self.builder.shared_params()}
        release(self.shared)
        declared = self.builder.layer_params()
        n_layers = self.builder.decoder.n_layers
        self.layers = []
        for i in tqdm(range(n_layers), total=n_layers, desc="loading weights", unit="layer", disable=None):
            self.layers.append({p.name: place(p, i) for p in declared})
            release(self.layers[-1])
        cache = self.builder.cache_spec("cache")
        self.kv_cache = KVCache(self.placement, n_layers, cache.dims, cache.dtype,
                                self.builder.cache_values_dtype())
        # Weights never change once placed: named for the unrolled program once, not every step.
        self._prefixed_weights = {layer_prefix(i) + name: buffer
                                  for i, weights in enumerate(self.layers)
                                  for name, buffer in weights.items()}
        self._prefixed_cache_names = [(layer_prefix(i) + "cache_k", layer_prefix(i) + "cache_v")
                                      for i in range(n_layers)]

    def weights_manifest(self) -> dict:
        """What presharded weights are made for: a replica's parts depend on these, not on the
        batch size or the buckets."""
        lowering = self.lowering
        return {"files": preshards.FILES, "tp_degree": lowering.tp_degree,
                "kv_split": lowering.kv_sharding.projections,
                "quant": lowering.quant.to_dict() if lowering.quant is not None else None,
                "gguf_blocks": [list(pair) for pair in lowering.gguf_blocks], "lowering": lowering.name,
                "weight_layout": lowering.weight_layout, "dtype": lowering.dtype,
                "head_dtype": lowering.head_dtype}

    def save_weights(self, directory: str | pathlib.Path) -> dict:
        """Write each replica's weights as it holds them to directory/weights/rank{r}.safetensors;
        the manifest to keep beside them. Across several processes each writes its own
        replicas' files (placement.local)."""
        if not self.loaded:
            raise ValueError("save(..., sharded_weights=True) writes the weights on the device: "
                             "call model.to_neuron() first")
        manifest = self.weights_manifest()
        tensors, values = [], {}
        declared = [(p, None, self.shared[p.name]) for p in self.builder.shared_params()]
        declared += [(p, i, weights[p.name]) for i, weights in enumerate(self.layers)
                     for p in self.builder.layer_params()]
        for param, layer, value in declared:
            spec, name = self.builder.spec(param), preshards.tensor_name(param.name, layer)
            tensors.append((name, numpy_dtype(spec.dtype), tuple(spec.dims)))
            values[name] = value
        for rank in self.placement.local:
            def fetch(name, rank=rank):
                return self.placement.host(values[name], rank)

            metadata = {"rank": str(rank), **{k: str(v) for k, v in manifest.items()}}
            preshards.write(preshards.rank_file(directory, rank), tensors, fetch, metadata)
        return manifest

    def check_presharded(self, directory: str | pathlib.Path, saved: dict) -> None:
        """A ValueError naming what differs when weights saved under `saved` (save_weights()'s
        manifest) are not what this session's programs take."""
        mine = self.weights_manifest()
        saved = {"kv_split": "heads", "quant": None, "gguf_blocks": [], **saved}    # saved before these
                                                                                     # existed
        for key in ("tp_degree", "kv_split", "quant", "gguf_blocks", "lowering", "weight_layout", "dtype",
                    "head_dtype"):
            if saved.get(key) != mine[key]:
                raise ValueError(f"{directory}: its presharded weights were saved for "
                                 f"{key}={saved.get(key)!r}, this model has {key}={mine[key]!r}")
        if saved.get("files") != preshards.FILES:
            raise ValueError(f"{directory}: unknown presharded weight files {saved.get('files')!r}")
        for rank in range(self.builder.tp_degree):
            if not preshards.rank_file(directory, rank).exists():
                raise ValueError(f"{directory}: {preshards.rank_file(directory, rank)} is missing")

    def device_bytes(self) -> list[int]:
        """Bytes of weights and KV caches on each replica this process holds, summed from the
        device buffers: every replica in one process; across several processes, this one's
        (placement.local), in replica order."""
        local = self.placement.local
        totals = [0] * len(local)
        values = [*self.shared.values(), *(v for layer in self.layers for v in layer.values()),
                  *self.kv_cache.keys, *self.kv_cache.values]
        for value in values:
            buffers = [value[r] for r in local] if isinstance(value, Replicas) else [value]
            for i, buffer in enumerate(buffers):
                totals[i] += buffer.nbytes
        return totals

    # -- logits on the host -----------------------------------------------------------------
    def host_logits(self, logits: Any) -> np.ndarray:
        """run_batch()'s logits as a new numpy f32 [batch, vocab] (check_drafts()'s [batch, n,
        vocab]): the replicas' blocks joined, the padding past the vocabulary trimmed. The one
        place full logits are gathered."""
        parts = [self.placement.host(logits, r) for r in range(self.builder.tp_degree)]
        return np.ascontiguousarray(
            np.concatenate(parts, axis=-1)[..., :self.builder.decoder.head.vocab_size])

    def device_logits(self, host: np.ndarray) -> Any:
        """host_logits()'s inverse: f32 [batch, vocab] put back as run_batch() returns them, each
        replica's block on it (the padding columns -inf, as the LM head masks them)."""
        width = self.builder.vocab_shard
        padded = np.full((host.shape[0], width * self.builder.tp_degree), -np.inf, np.float32)
        padded[:, :host.shape[1]] = host
        return self.placement.put_each([np.ascontiguousarray(padded[:, r * width:(r + 1) * width])
                                        for r in range(self.builder.tp_degree)])

    # -- running ---------------------------------------------------------------------------
    def pad_buffer(self, pads: np.ndarray) -> Any:
        """pads on the device, uploaded once per distinct value."""
        if self._pads is None or not np.array_equal(self._pads, pads):
            self._pads = np.array(pads, dtype=np.int32)
            self._pad_buffer = self.placement.put(self._pads)
            self._step_buffers.clear()            # positions depend on the pads
        return self._pad_buffer

    def _step_buffer(self, key: tuple, make: Any) -> Any:
        """make() on the device, kept under `key` (for the pads of the last pad_buffer())."""
        if key not in self._step_buffers:
            if len(self._step_buffers) >= 4 * self.n_positions:
                self._step_buffers.clear()
            self._step_buffers[key] = self.placement.put(make())
        return self._step_buffers[key]

    @staticmethod
    def positions(pads: np.ndarray, n_tokens: int, slot: int | np.ndarray) -> np.ndarray:
        """Positions of n_tokens written at `slot` (or at each line's own slot): the slot
        minus each line's left padding."""
        slots = np.asarray(slot, np.int32).reshape(-1, 1) + np.arange(n_tokens, dtype=np.int32)[None, :]
        return np.maximum(slots - pads[:, None], 0).astype(np.int32)

    def _check_slots(self, slot: int, n_tokens: int) -> None:
        if not self.loaded:
            raise RuntimeError("call model.to_neuron() first: the weights are not on the device")
        if slot < 0 or slot + n_tokens > self.n_positions:
            raise ValueError(f"cache slots {slot}..{slot + n_tokens - 1} are outside the cache of "
                             f"n_positions {self.n_positions}")

    def run_batch(self, token_ids: Any, slot: int, pads: np.ndarray, n_tokens: int | None = None) -> Any:
        """The whole batch, every line from the same `slot` (a prompt, or a decode step): f32
        logits [batch, vocab] (a device buffer) of the last of the tokens written at `slot`;
        under tensor parallelism each replica's block, [batch, vocab_shard] (host_logits()
        joins them). token_ids: [batch, n] as numpy, or a device buffer (give n_tokens then)."""
        if n_tokens is None:
            n_tokens = int(np.shape(token_ids)[1])
        self._check_slots(slot, n_tokens)
        pads = np.asarray(pads, dtype=np.int32)
        if n_tokens == 1:
            return self._decode(token_ids, slot, pads)[0]
        return self._prefill(np.asarray(token_ids, dtype=np.int32), slot, pads)

    def decode(self, token_ids: Any, slot: int, pads: np.ndarray) -> tuple[Any, Any | None]:
        """A decode step, run_batch() of one token per line ([batch, 1], numpy or on the device):
        its logits, and each line's most likely token (s32[batch, 1] on the device) where the
        decode program makes them (the whole-model program does), else None."""
        self._check_slots(slot, 1)
        return self._decode(token_ids, slot, np.asarray(pads, dtype=np.int32))

    def _decode(self, token_ids: Any, slot: int, pads: np.ndarray) -> tuple[Any, Any | None]:
        n_attend = bucketing.pick(self.decode_buckets(), slot + 1)
        return self._run(token_ids, 1, n_attend, slot, pads, 0, with_greedy=True)

    def _prefill(self, ids: np.ndarray, start: int, pads: np.ndarray) -> Any:
        """Prefill in chunks of the context buckets; logits of the last token."""
        length = ids.shape[1]
        largest = self.context_buckets[-1]
        done = 0
        while True:
            remaining = length - done
            size = bucketing.pick(self.context_buckets, remaining) if remaining <= largest else largest
            # A chunk that would run past the cache starts earlier, rewriting the same values;
            # when those are not at hand (a prefill that continues a cache), one token at a time.
            at = min(start + done, self.n_positions - size)
            if at < start:
                return self._one_by_one(ids[:, done:], start + done, pads)
            chunk = np.zeros((self.batch_size, size), np.int32)
            part = ids[:, at - start: at - start + size]
            chunk[:, : part.shape[1]] = part
            n_attend = size if at == 0 else bucketing.pick(self.token_buckets, at + size)
            last = at + size >= start + length
            logits = self._run(chunk, size, n_attend, at, pads, start + length - 1 - at if last else size - 1)
            if last:
                return logits
            done = at - start + size

    def _one_by_one(self, ids: np.ndarray, slot: int, pads: np.ndarray) -> Any:
        for j in range(ids.shape[1]):
            n_attend = bucketing.pick(self.decode_buckets(), slot + j + 1)
            logits = self._run(np.ascontiguousarray(ids[:, j:j + 1]), 1, n_attend, slot + j, pads, 0)
        return logits

    def step_every_line(self, token_ids: np.ndarray, slots: np.ndarray, last_index: np.ndarray) -> Any:
        """Continuous batching, one program over every line (a chunk of each prompt being
        written, or each line's newest token): line i's n tokens token_ids[i] written at its
        own slots slots[i] .. slots[i] + n - 1 (n is 1 or a context bucket); logits (on the
        device) of each line's token last_index[i]. A line at slot n_positions has no part in
        the step."""
        if not self.per_line:
            raise ValueError("step_every_line() needs a model built with continuous batching "
                             "(NeuronConfig(continuous_batching=ContinuousBatchingConfig(...)))")
        token_ids = np.asarray(token_ids, np.int32)
        slots, last_index = np.asarray(slots, np.int32), np.asarray(last_index, np.int32)
        b, n = token_ids.shape
        if b != self.batch_size or slots.shape != (b,) or last_index.shape != (b,):
            raise ValueError(f"step_every_line: token_ids [{self.batch_size}, n], slots and last_index "
                             f"[{self.batch_size}]; got {token_ids.shape}, {slots.shape}, {last_index.shape}")
        if n != 1 and n not in self.context_buckets:
            raise ValueError(f"step_every_line: a chunk of {n} tokens; use 1 or a context bucket "
                             f"{self.context_buckets}")
        live = slots < self.n_positions
        if ((slots < 0).any() or (slots > self.n_positions).any() or (last_index < 0).any()
                or (last_index >= n).any()):
            raise ValueError(f"step_every_line: slots must be in 0..{self.n_positions} ({self.n_positions}: "
                             f"no part in the step) and last_index in 0..{n - 1}; got {slots.tolist()}, "
                             f"{last_index.tolist()}")
        reach = slots[live] + last_index[live] + 1
        if (reach > self.n_positions).any():
            raise ValueError(f"step_every_line: a line's last token would be at slot {int(reach.max()) - 1}, "
                             f"past n_positions {self.n_positions}")
        longest = int(reach.max()) if live.any() else 1
        if n == 1:
            n_attend = bucketing.pick(self.decode_buckets(), longest)
        else:
            n_attend = n if longest <= n else bucketing.pick(self.token_buckets, longest)
        # A line with no part in the step attends to its own scratch slot only (pad = slot),
        # not to the n_positions slots below it.
        pads = np.where(live, 0, self.n_positions).astype(np.int32)
        return self._run(token_ids, n, n_attend, slots, pads, last_index)

    def prefill_line(self, token_ids: np.ndarray, line: int, slot: int, last_index: int,
                     every_position: bool = False) -> Any:
        """Continuous batching, one line's prompt chunk: n tokens (a context bucket) of one line
        written at slots slot .. slot + n - 1 of that line alone; logits (on the device)
        [1, vocab] of token last_index (every_position: [1, n, vocab] of every token, for a
        prompt's logprobs). The other lines' caches are untouched and their rows are not
        computed."""
        if not self.row_prefill:
            raise ValueError("prefill_line() needs a continuous-batching model of more than one line whose "
                             "caches are not spread over replicas (no flash decoding, no lines split by "
                             "replica)")
        token_ids = np.asarray(token_ids, np.int32)
        n = token_ids.shape[-1]
        if token_ids.shape != (1, n) or n not in self.context_buckets:
            raise ValueError(f"prefill_line: token_ids [1, n] with n a context bucket "
                             f"{self.context_buckets}; got {token_ids.shape}")
        if not 0 <= line < self.batch_size or not 0 <= last_index < n or slot < 0 \
                or slot + last_index + 1 > self.n_positions:
            raise ValueError(f"prefill_line: line in 0..{self.batch_size - 1}, last_index in 0..{n - 1} and "
                             f"the last token's slot below n_positions {self.n_positions}; got line {line}, "
                             f"slot {slot}, last_index {last_index}")
        reach = slot + last_index + 1
        n_attend = n if reach <= n else bucketing.pick(self.token_buckets, reach)
        return self._run(token_ids, n, n_attend, np.array([slot], np.int32), np.zeros(1, np.int32),
                         np.array([last_index], np.int32), lines=np.array([line], np.int32),
                         every_position=every_position)

    def prefill_lines(self, token_ids: np.ndarray, lines: np.ndarray, slots: np.ndarray,
                      last_index: np.ndarray, every_position: bool = False) -> np.ndarray:
        """Continuous batching, the prompt chunks of k lines in one program: token_ids[i] (n
        tokens, a context bucket) written into line lines[i] at slots slots[i] .. slots[i] + n - 1.
        Logits on the host, f32 [k, vocab] of each line's token last_index[i], in the order given
        (every_position: [k, n, vocab]). The programs are those for the smallest of decode_rows()
        that holds k rows (rows past k write into other lines' scratch slots, as in
        decode_lines()), or the program over every line, where the lines not given have no part.
        The other lines' caches below n_positions are untouched. Programs for several lines of
        chunks wider than batched_prefill_buckets() are compiled on first use."""
        if not self.row_prefill:
            raise ValueError("prefill_lines() needs a continuous-batching model of more than one line whose "
                             "caches are not spread over replicas (no flash decoding, no lines split by "
                             "replica)")
        token_ids = np.asarray(token_ids, np.int32)
        lines, slots = np.asarray(lines, np.int32), np.asarray(slots, np.int32)
        last_index = np.asarray(last_index, np.int32)
        b = self.batch_size
        if token_ids.ndim != 2 or not 1 <= token_ids.shape[0] <= b \
                or token_ids.shape[1] not in self.context_buckets:
            raise ValueError(f"prefill_lines: token_ids [k, n] with k in 1..{b} lines and n a context bucket "
                             f"{self.context_buckets}; got {token_ids.shape}")
        k, n = token_ids.shape
        if lines.shape != (k,) or slots.shape != (k,) or last_index.shape != (k,):
            raise ValueError(f"prefill_lines: lines, slots and last_index [{k}], one per row of token_ids; "
                             f"got {lines.shape}, {slots.shape}, {last_index.shape}")
        if len(set(lines.tolist())) != k or (lines < 0).any() or (lines >= b).any():
            raise ValueError(f"prefill_lines: distinct lines in 0..{b - 1}; got {lines.tolist()}")
        reach = slots + last_index + 1
        if (slots < 0).any() or (last_index < 0).any() or (last_index >= n).any() \
                or (reach > self.n_positions).any():
            raise ValueError(f"prefill_lines: slots >= 0, last_index in 0..{n - 1} and each last token's "
                             f"slot below n_positions {self.n_positions}; got slots {slots.tolist()}, "
                             f"last_index {last_index.tolist()}")
        longest = int(reach.max())
        n_attend = n if longest <= n else bucketing.pick(self.token_buckets, longest)
        fitting = [r for r in self.decode_rows() if r >= k]
        if fitting:
            rows = fitting[0]
            token_ids, lines, slots, last_index = self._padding_rows(rows, token_ids, lines, slots,
                                                                     last_index)
            logits = self._run(token_ids, n, n_attend, slots, np.zeros(rows, np.int32), last_index,
                               lines=lines, every_position=every_position)
            return self.host_logits(logits)[:k]
        # Every line's row: each line given at its own; the others have no part (as in
        # step_every_line(): at slot n_positions, attending to their scratch slot only).
        every_tokens = np.zeros((b, n), np.int32)
        every_tokens[lines] = token_ids
        every_slots = np.full(b, self.n_positions, np.int32)
        every_slots[lines] = slots
        every_last = np.zeros(b, np.int32)
        every_last[lines] = last_index
        pads = np.where(every_slots < self.n_positions, 0, self.n_positions).astype(np.int32)
        logits = self._run(every_tokens, n, n_attend, every_slots, pads, every_last,
                           every_position=every_position)
        return self.host_logits(logits)[lines]

    def copy_line(self, source: int, target: int, slots: int | None = None) -> None:
        """Continuous batching: line `target`'s cache made a copy of line `source`'s, every
        layer, its first `slots` slots (None: the whole line): a prompt's keys and values
        computed once for several choices, or for prompts sharing a prefix. One program copies
        a window of the narrowest context bucket's slots; it runs once a window. Needs whole
        lines on each device (row_prefill)."""
        if not self.row_prefill:
            raise ValueError("copy_line() needs a continuous-batching model whose lines are whole on each "
                             "device")
        if not (0 <= source < self.batch_size and 0 <= target < self.batch_size):
            raise ValueError(f"copy_line: lines in 0..{self.batch_size - 1}; got {source}, {target}")
        window = self.context_buckets[0]
        program = self.programs.get(CopyLine(window))
        cache = self.kv_cache
        for offset in range(0, cache.dims[2] if slots is None else slots, window):
            values = {"source": np.int32(source), "target": np.int32(target), "offset": np.int32(offset)}
            for layer, (k, v) in enumerate(self._prefixed_cache_names):
                values[k], values[v] = cache.keys[layer], cache.values[layer]
            outputs = program.run(values)
            for layer, (k, v) in enumerate(self._prefixed_cache_names):
                cache.keys[layer], cache.values[layer] = outputs[k], outputs[v]

    def decode_lines(self, token_ids: np.ndarray, lines: np.ndarray, slots: np.ndarray) -> Any:
        """Continuous batching, the active lines' decode step: one token each for k lines,
        token_ids[i] written into line lines[i] at slot slots[i] (n_positions: no part, its
        line's scratch slot), in the programs for the smallest of decode_rows() that holds k
        rows; rows past k go to other lines' scratch slots. Logits (on the device) [rows,
        vocab], the k given rows first. The other lines are not computed."""
        token_ids = np.asarray(token_ids, np.int32).reshape(-1)
        lines, slots = np.asarray(lines, np.int32), np.asarray(slots, np.int32)
        k = token_ids.shape[0]
        fitting = [r for r in self.decode_rows() if r >= k]
        if k < 1 or not fitting or lines.shape != (k,) or slots.shape != (k,):
            most = max(self.decode_rows(), default=0)
            raise ValueError(f"decode_lines: token_ids, lines and slots [k] with k rows one of 1..{most}; "
                             f"got {token_ids.shape}, {lines.shape}, {slots.shape}")
        if len(set(lines.tolist())) != k or (lines < 0).any() or (lines >= self.batch_size).any() \
                or (slots < 0).any() or (slots > self.n_positions).any():
            raise ValueError(f"decode_lines: distinct lines in 0..{self.batch_size - 1} and slots in "
                             f"0..{self.n_positions}; got {lines.tolist()}, {slots.tolist()}")
        rows = fitting[0]
        token_ids, lines, slots, last_index = self._padding_rows(rows, token_ids.reshape(k, 1), lines, slots,
                                                                 np.zeros(k, np.int32))
        live = slots < self.n_positions
        n_attend = bucketing.pick(self.decode_buckets(), int(slots[live].max()) + 1 if live.any() else 1)
        # A padding row's line starts at its scratch slot too: it attends to that slot alone.
        pads = np.where(live, 0, self.n_positions).astype(np.int32)
        return self._run(token_ids, 1, n_attend, slots, pads, last_index, lines=lines)

    def _padding_rows(self, rows: int, token_ids: np.ndarray, lines: np.ndarray, slots: np.ndarray,
                      last_index: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The k given rows made `rows`: the rows added name lines not given, at slot n_positions
        (their scratch slot: no part in the step), with zero tokens."""
        k, n = token_ids.shape
        given = set(lines.tolist())
        others = np.asarray([line for line in range(self.batch_size) if line not in given][:rows - k],
                            np.int32)
        return (np.concatenate([token_ids, np.zeros((rows - k, n), np.int32)]),
                np.concatenate([lines, others]),
                np.concatenate([slots, np.full(rows - k, self.n_positions, np.int32)]),
                np.concatenate([last_index, np.zeros(rows - k, np.int32)]))

    def check_drafts(self, token_ids: np.ndarray, slot: int, pads: np.ndarray) -> Any:
        """Speculative decoding's check of draft tokens in one program: the logits (on the
        device) of every one of the n tokens written at `slot`, f32 [batch, n, vocab]."""
        token_ids = np.asarray(token_ids, np.int32)
        n = token_ids.shape[1]
        if slot < 0 or slot + n > self.n_positions:
            raise ValueError(f"cache slots {slot}..{slot + n - 1} are outside the cache of n_positions "
                             f"{self.n_positions}")
        n_attend = bucketing.pick(self.token_buckets, slot + n)
        return self._run(token_ids, n, n_attend, slot, np.asarray(pads, np.int32), 0, every_position=True)

    def _run(self, token_ids: Any, n_tokens: int, n_attend: int, slot: int | np.ndarray, pads: np.ndarray,
             last_index: int | np.ndarray, every_position: bool = False, lines: np.ndarray | None = None,
             with_greedy: bool = False) -> Any:
        """The logits; with_greedy: (logits, the decode program's greedy tokens or None)."""
        if isinstance(token_ids, np.ndarray):
            token_ids = self.placement.put(np.ascontiguousarray(token_ids, dtype=np.int32))
        if lines is not None:
            return self._run_rows(token_ids, n_tokens, n_attend, slot, pads, last_index, lines,
                                  every_position=every_position)
        kept = self._step_buffer
        pad = self.pad_buffer(pads)
        b = self.batch_size
        if self.per_line:
            slot = np.broadcast_to(np.asarray(slot, np.int32), (b,))
            slot_key, slot_value = tuple(slot.tolist()), (lambda: np.ascontiguousarray(slot))
        else:
            slot_key, slot_value = int(slot), (lambda: np.int32(slot))
        lasts = np.broadcast_to(np.asarray(last_index, np.int32), (b,))
        step = {"positions": kept(("positions", n_tokens, slot_key),
                                  lambda: self.positions(pads, n_tokens, slot)),
                "slot": kept(("slot", slot_key), slot_value), "pad": pad,
                "last_index": kept(("last_index", tuple(lasts.tolist())),
                                   lambda: np.ascontiguousarray(lasts)),
                "token_ids": token_ids}
        if self._runs_whole_model(n_tokens, every_position):
            outputs = self._run_whole(step, n_tokens, n_attend)
            if "next_slot" in outputs:
                # The next step's inputs, already on the device: kept for when it comes.
                self._step_buffers[("positions", 1, slot_key + 1)] = outputs["next_positions"]
                self._step_buffers[("slot", slot_key + 1)] = outputs["next_slot"]
            return (outputs["logits"], outputs["greedy_tokens"]) if with_greedy else outputs["logits"]
        embed = self.programs.get(Embed(n_tokens))
        hidden = embed.run({**step, **self.shared})["hidden"]
        hidden = self._run_layers(hidden, step, n_tokens, n_attend)
        head = self.programs.get(LMHeadAll(n_tokens) if every_position else LMHead(n_tokens))
        logits = head.run({**step, "hidden": hidden, **self.shared})["logits"]
        return (logits, None) if with_greedy else logits

    def _run_rows(self, token_ids: Any, n_tokens: int, n_attend: int, slots: np.ndarray, pads: np.ndarray,
                  last_index: np.ndarray, lines: np.ndarray, every_position: bool = False) -> Any:
        """Some lines' rows: the programs for len(lines) rows, each naming its cache line."""
        rows = len(lines)
        kept = self._step_buffer
        step = {"positions": kept(("row_positions", n_tokens, tuple(slots.tolist())),
                                  lambda: self.positions(pads, n_tokens, slots)),
                "slot": kept(("row_slot", tuple(slots.tolist())), lambda: np.ascontiguousarray(slots)),
                "pad": kept(("row_pad", tuple(pads.tolist())), lambda: np.ascontiguousarray(pads)),
                "lines": kept(("row_lines", tuple(lines.tolist())), lambda: np.ascontiguousarray(lines)),
                "last_index": kept(("row_last", tuple(last_index.tolist())),
                                   lambda: np.ascontiguousarray(last_index)),
                "token_ids": token_ids}
        if self._runs_whole_model(n_tokens, every_position):
            return self._run_whole(step, n_tokens, n_attend, rows)["logits"]
        hidden = self.programs.get(Embed(n_tokens, rows)).run({**step, **self.shared})["hidden"]
        hidden = self._run_layers(hidden, step, n_tokens, n_attend, rows)
        head = LMHeadAll(n_tokens, rows) if every_position else LMHead(n_tokens, rows)
        return self.programs.get(head).run({**step, "hidden": hidden, **self.shared})["logits"]

    def _run_layers(self, hidden: Any, step: dict[str, Any], n_tokens: int, n_attend: int,
                    rows: int | None = None) -> Any:
        decoder = self.builder.decoder
        blocks = [self.programs.get(Block(n_tokens, n_attend, rows, kind))
                  for kind in range(len(decoder.kinds))]
        block = blocks[0]
        cache = self.kv_cache
        # Checked once through the named path; the other layers, of any kind (whose programs
        # take the same parameters), reuse the same order.
        first = blocks[decoder.kind_of(0)].run({**self.layers[0], **step, "hidden": hidden,
                                              "cache_k": cache.keys[0], "cache_v": cache.values[0]})
        hidden, cache.keys[0], cache.values[0] = first["hidden"], first["cache_k"], first["cache_v"]
        names = block.program.param_names
        at_hidden, at_k, at_v = names.index("hidden"), names.index("cache_k"), names.index("cache_v")
        out_hidden, out_k, out_v = (block.program.outputs.index(n) for n in ("hidden", "cache_k", "cache_v"))
        for layer in range(1, len(self.layers)):
            block = blocks[decoder.kind_of(layer)]
            weights = self.layers[layer]
            args = [weights[name] if name in weights else step.get(name) for name in names]
            args[at_hidden], args[at_k], args[at_v] = hidden, cache.keys[layer], cache.values[layer]
            outputs = block.run_buffers(args)
            hidden, cache.keys[layer], cache.values[layer] = (outputs[out_hidden], outputs[out_k],
                                                              outputs[out_v])
        return hidden

    def _run_whole(self, step: dict[str, Any], n_tokens: int, n_attend: int,
                   rows: int | None = None) -> dict[str, Any]:
        program = self.programs.get(ModelStep(n_tokens, n_attend, rows))
        cache = self.kv_cache
        caches = self._prefixed_cache_names
        values = {**step, **self.shared, **self._prefixed_weights}
        for layer, (k, v) in enumerate(caches):
            values[k], values[v] = cache.keys[layer], cache.values[layer]
        outputs = program.run_checked_once(values)
        for layer, (k, v) in enumerate(caches):
            cache.keys[layer], cache.values[layer] = outputs[k], outputs[v]
        return outputs
