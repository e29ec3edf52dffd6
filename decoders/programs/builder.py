"""The PyHLO programs of a decoder, written from its pieces and the platform's lowering.

Every program declares its parameters as named specs (`ParamSpec`) and names its outputs,
so callers bind arguments and read results by name, never by a positional order kept by
hand. Parameter specs of weights come from the pieces' declarations (`Param`), laid out
and typed by the lowering.

- embed:      token ids (and positions) -> hidden states
- block:      one decoder layer (reused by every layer of its kind with that layer's weights); writes
              the new keys and values into the KV caches in place (aliased) and attends over
              the first `n_attend` slots
- lm_head:    final norm + vocabulary projection of one position per line -> f32 logits
- model_step: all of it unrolled in one program; layer i's parameters are `layer{i}.NAME`
- greedy / sampler: the next token of every line, on the device

Under tensor parallelism the logits stay split by vocabulary: each replica's lm_head and
model_step return its `vocab_shard` columns, and greedy / sampler gather each replica's
best candidates, never the logits.
"""
from __future__ import annotations

from dataclasses import dataclass

from decoders.blocks.embedding import HEAD_WEIGHT
from decoders.blocks.layer import Decoder
from decoders.blocks.params import Param, declare_quantized
from decoders.blocks.step import Step
from decoders.blocks.values import PieceValues
from decoders.lowering import XlaLowering
from decoders.parallel import replica, sharding
from decoders.weights.stored import BLOCK_FORMS
from pyhlo import Scribe, compile_py_func
from pyhlo.ops import elementwise as ew
from pyhlo.ops import sampling
from pyhlo.ops.shape_ops import dynamic_slice, dynamic_update_slice, reshape
from pyhlo.schema import hlo_pb2
from pyhlo.scribe import HloValue


@dataclass(frozen=True)
class ParamSpec:
    name: str
    dtype: str
    dims: tuple[int, ...]


@dataclass(frozen=True)
class Program:
    """One HLO module with its named parameters and outputs."""

    name: str
    module: hlo_pb2.HloModuleProto
    params: tuple[ParamSpec, ...]
    outputs: tuple[str, ...]

    @property
    def param_names(self) -> list[str]:
        return [p.name for p in self.params]


def _program(name: str, specs: list[ParamSpec], outputs: list[str], body, f32_dot_precision: str) -> Program:
    """Write a module whose entry takes `specs` and returns body(params) as named outputs."""

    def entry(scribe: Scribe):
        params = {spec.name: getattr(scribe, spec.dtype)[spec.dims].Parameter(parameter_number=i,
                                                                                parameter_name=spec.name)
                  for i, spec in enumerate(specs)}
        results = body(params)
        return [results[o] for o in outputs]

    entry.__name__ = name
    module = compile_py_func(entry, name=name, f32_dot_precision=f32_dot_precision)
    return Program(name, module, tuple(specs), tuple(outputs))


def layer_prefix(layer: int) -> str:
    return f"layer{layer}."


@dataclass(frozen=True)
class ProgramBuilder:
    """Writes every program of one compiled model (embed, block, lm_head, model_step, greedy,
    sampler) for a batch size and cache length, from the decoder's pieces and the lowering.

    It is the one place that turns the pieces' declarations into program parameters: the
    model builds one per batch size, the compiled set (programs/compiled.py) asks it for each
    bucket's programs, and the session and `pyhlo inspect` read its parameter specs. It writes
    programs only: it holds no weights or caches and runs nothing.
    """

    decoder: Decoder
    batch_size: int
    cache_len: int          # every layer's cache holds this many slots (n_positions, plus scratch)
    lowering: XlaLowering
    # Continuous batching: each line writes at its own slot (`slot` is s32[batch]).
    per_line_slots: bool = False

    @property
    def dtype(self) -> str:
        return self.lowering.dtype

    @property
    def tp_degree(self) -> int:
        return self.lowering.tp_degree

    @property
    def device_decoder(self) -> Decoder:
        """The pieces as one device runs them (its share of the heads under tensor parallelism)."""
        decoder = self.decoder.sharded(self.tp_degree, self.lowering.kv_sharding)
        if self.lowering.kv_cache_quant:
            return decoder.with_kv_quant()
        cache_type = self.lowering.kv_cache_dtype
        return decoder.with_cache_type(cache_type) if cache_type not in (None, self.dtype) else decoder

    @property
    def one_table(self) -> bool:
        """Tied embeddings stored once: the LM head table also serves as the token table (not
        under tensor parallelism, where the head is split by vocabulary and the table is not)."""
        return (self.decoder.tied and self.tp_degree == 1
                and (self.lowering.head_dtype == self.dtype or HEAD_WEIGHT in self.lowering.block_forms))

    @property
    def vocab_shard(self) -> int:
        """Logit columns one replica holds: the vocabulary (padded to a multiple of tp_degree)
        over tp_degree; the whole vocabulary on one device."""
        head = next(p for p in self.decoder.head.params() if p.name == HEAD_WEIGHT)
        return sharding.local_shape(head, self.tp_degree)[0]

    def check_sharding(self) -> None:
        """Every parameter and cache splits over tp_degree devices (else a ValueError naming it)."""
        self.cache_spec("cache")
        for param in self.layer_params() + self.shared_params():
            self.lowering.param_dims(param)

    # -- parameter specs --------------------------------------------------------------
    def spec(self, param: Param, prefix: str = "") -> ParamSpec:
        return ParamSpec(prefix + param.name, self.lowering.param_dtype(param),
                         self.lowering.param_dims(param))

    def layer_params(self) -> list[Param]:
        return declare_quantized(self.decoder.layer.params(), self.lowering.quant, self.lowering.block_forms)

    def head_params(self) -> list[Param]:
        """The final norm's and the LM head's (its weight in a GGUF block form, if the file has it)."""
        return declare_quantized(self.decoder.head.params(), None, self.lowering.block_forms)

    def shared_params(self) -> list[Param]:
        return self.decoder.embedding.params(include_tokens=not self.one_table) + self.head_params()

    def cache_spec(self, name: str) -> ParamSpec:
        """One device's KV cache of one layer."""
        attention = self.device_decoder.layer.attention
        return ParamSpec(name, attention.cache_dtype(self.dtype),
                         attention.cache_dims(self.batch_size, self.cache_len))

    def cache_values_dtype(self) -> str:
        """The type of the keys and values the caches hold (cache_spec's type is their bits' for
        16-bit floats)."""
        return self.device_decoder.layer.attention.cache_values_dtype(self.dtype)

    def _rows(self, rows: int | None) -> int:
        """A program's batch: every line (None), or `rows` of them (continuous batching)."""
        if rows is None or rows == self.batch_size:
            return self.batch_size
        if not self.per_line_slots or not 1 <= rows < self.batch_size:
            raise ValueError(f"programs for {rows} of the {self.batch_size} lines need continuous batching")
        return rows

    def _step_specs(self, n_tokens: int, rows: int | None = None) -> list[ParamSpec]:
        b = self._rows(rows)
        slot = (b,) if self.per_line_slots else ()
        specs = [ParamSpec("positions", "s32", (b, n_tokens)), ParamSpec("slot", "s32", slot),
                 ParamSpec("pad", "s32", (b,))]
        if b != self.batch_size:
            specs.append(ParamSpec("lines", "s32", (b,)))      # each row's cache line
        return specs

    def _embed_specs(self, n_tokens: int, rows: int | None = None) -> list[ParamSpec]:
        b = self._rows(rows)
        specs = [ParamSpec("token_ids", "s32", (b, n_tokens))]
        if self.decoder.embedding.positions is not None:
            specs.append(ParamSpec("positions", "s32", (b, n_tokens)))
        table = self.decoder.token_table(self.one_table)
        embedding = [p for p in self.shared_params()
                     if p.name.startswith("embed.") or table in (p.name, p.part_of)]
        return specs + [self.spec(p) for p in embedding]

    # -- bodies -------------------------------------------------------------------------
    def _embed(self, p: dict[str, HloValue]) -> HloValue:
        embedding = self.decoder.embedding
        values = PieceValues(p, self.lowering, "embed", embedding.params(include_tokens=not self.one_table))
        table = self.decoder.token_table(self.one_table)
        # The LM head's GGUF blocks as the token table: its scales (and minimums) come along.
        parts = [p[f"{table}.{part}"] for part in ("scale", "min") if f"{table}.{part}" in p]
        form = BLOCK_FORMS.get(self.lowering.block_forms.get(table, ""))
        return embedding(values, p[table], p["token_ids"], p.get("positions"), self.dtype, *parts,
                         table_ggml_type=form.ggml_type if form is not None and form.as_file else None)

    def _layer(self, p: dict[str, HloValue], n_tokens: int, n_attend: int,
               kind: int = 0) -> dict[str, HloValue]:
        step = Step(p["positions"], p["slot"], p["pad"], n_tokens, n_attend, p.get("lines"))
        layer = self.device_decoder.kinds[kind]
        hidden, cache_k, cache_v = layer(p, self.lowering, p["hidden"], step, p["cache_k"], p["cache_v"])
        cache_k.set_alias_to(p["cache_k"], must=True)
        cache_v.set_alias_to(p["cache_v"], must=True)
        return {"hidden": hidden, "cache_k": cache_k, "cache_v": cache_v}

    def _head(self, p: dict[str, HloValue]) -> HloValue:
        values = PieceValues(p, self.lowering, "", self.head_params())
        return self.decoder.head(values, p["hidden"], p["last_index"])

    # -- programs ------------------------------------------------------------------------
    def _program(self, name: str, specs: list[ParamSpec], outputs: list[str], body) -> Program:
        return _program(name, specs, outputs, body, self.lowering.f32_dot_precision)

    def _rows_suffix(self, rows: int | None) -> str:
        return "" if self._rows(rows) == self.batch_size else f"_r{rows}"

    def embed(self, n_tokens: int, rows: int | None = None) -> Program:
        return self._program(f"embed_n{n_tokens}{self._rows_suffix(rows)}", self._embed_specs(n_tokens, rows),
                             ["hidden"], lambda p: {"hidden": self._embed(p)})

    def block(self, n_tokens: int, n_attend: int, rows: int | None = None, kind: int = 0) -> Program:
        """One layer of kind `kind` (Decoder.kinds) over n_tokens of every line, or of `rows`
        lines named by the `lines` input (whose caches are still every line's)."""
        d, b = self.decoder, self._rows(rows)
        specs = [ParamSpec("hidden", self.dtype, (b, n_tokens, d.embedding.hidden)),
                 *self._step_specs(n_tokens, rows), self.cache_spec("cache_k"), self.cache_spec("cache_v"),
                 *(self.spec(p) for p in self.layer_params())]
        name = f"block_n{n_tokens}_s{n_attend}{self._rows_suffix(rows)}" + (f"_k{kind}" if kind else "")
        return self._program(name, specs, ["hidden", "cache_k", "cache_v"],
                             lambda p: self._layer(p, n_tokens, n_attend, kind))

    def lm_head(self, n_tokens: int, rows: int | None = None) -> Program:
        b = self._rows(rows)
        specs = [ParamSpec("hidden", self.dtype, (b, n_tokens, self.decoder.head.hidden)),
                 ParamSpec("last_index", "s32", (b,)), *(self.spec(p) for p in self.head_params())]
        return self._program(f"lm_head_n{n_tokens}{self._rows_suffix(rows)}", specs, ["logits"],
                             lambda p: {"logits": self._head(p)})

    def lm_head_all(self, n_tokens: int, rows: int | None = None) -> Program:
        b = self._rows(rows)
        specs = [ParamSpec("hidden", self.dtype, (b, n_tokens, self.decoder.head.hidden)),
                 *(self.spec(p) for p in self.head_params())]

        def body(p):
            values = PieceValues(p, self.lowering, "", self.head_params())
            return {"logits": self.decoder.head.every_position(values, p["hidden"])}

        return self._program(f"lm_head_all_n{n_tokens}{self._rows_suffix(rows)}", specs, ["logits"], body)

    def copy_line(self, slots: int) -> Program:
        """Every layer's caches with `slots` slots of line `source`'s keys and values from slot
        `offset` copied into line `target`, in place, in one program: choices of one prompt, or
        prompts sharing a prefix, share its computed keys and values. Parameters of layer i are
        named `layer{i}.cache_k` / `.cache_v`. A window past the caches' end is moved back to
        end there (XLA clamps both slices alike): it copies slots the source holds to the same
        slots of the target."""
        specs = [ParamSpec(layer_prefix(i) + s.name, s.dtype, s.dims)
                 for i in range(self.decoder.n_layers)
                 for s in (self.cache_spec("cache_k"), self.cache_spec("cache_v"))]
        names = [s.name for s in specs]
        specs += [ParamSpec(name, "s32", ()) for name in ("source", "target", "offset")]

        def body(p):
            out = {}
            for name in names:
                cache = p[name]
                start = [p["offset"] if axis == 2 else 0 for axis in range(1, len(cache.dims))]
                width = [cache.dims[1], min(slots, cache.dims[2]), *cache.dims[3:]]
                line = dynamic_slice(cache, [p["source"], *start], [1, *width])
                out[name] = dynamic_update_slice(cache, line, [p["target"], *start])
                out[name].set_alias_to(cache, must=True)
            return out

        return self._program(f"copy_line_s{slots}", specs, names, body)

    def model_step(self, n_tokens: int, n_attend: int, rows: int | None = None) -> Program:
        """The whole model unrolled into one program: token ids -> logits and each line's most
        likely token, every layer's caches updated in place; over every line, or over `rows`
        lines named by the `lines` input (as block() takes them). Parameters of layer i are
        named `layer{i}.NAME`."""
        d, b = self.decoder, self._rows(rows)
        per_layer = [self.cache_spec("cache_k"), self.cache_spec("cache_v"),
                     *(self.spec(p) for p in self.layer_params())]
        embed = self._embed_specs(n_tokens, rows)
        names = {s.name for s in embed}
        specs = [embed[0], *self._step_specs(n_tokens, rows), ParamSpec("last_index", "s32", (b,)),
                 *[s for s in embed[1:] if s.name != "positions"],
                 *(self.spec(p) for p in self.head_params() if p.name not in names),
                 *(ParamSpec(layer_prefix(i) + s.name, s.dtype, s.dims) for i in range(d.n_layers)
                   for s in per_layer)]
        # The greedy tokens too: a greedy decode step is then this one program.
        outputs = ["logits", "greedy_tokens"]
        outputs += [f"{layer_prefix(i)}{c}" for i in range(d.n_layers) for c in ("cache_k", "cache_v")]
        # The next step's positions and slot, made on the device: a decode loop passes them
        # on instead of uploading new ones every token. Not per line: there a line with no
        # part in the step stays where it is.
        advance = not self.per_line_slots
        if advance:
            outputs += ["next_positions", "next_slot"]

        def body(p):
            hidden = self._embed(p)
            results = {}
            for i in range(d.n_layers):
                prefix = layer_prefix(i)
                layer = {s.name: p[prefix + s.name] for s in per_layer}
                out = self._layer({**p, **layer, "hidden": hidden}, n_tokens, n_attend, d.kind_of(i))
                hidden = out["hidden"]
                results[prefix + "cache_k"], results[prefix + "cache_v"] = out["cache_k"], out["cache_v"]
            results["logits"] = self._head({**p, "hidden": hidden})
            results["greedy_tokens"] = self._greedy_tokens(results["logits"])
            if advance:
                results["next_positions"] = ew.add(p["positions"], n_tokens)
                results["next_slot"] = ew.add(p["slot"], n_tokens)
            return results

        return self._program(f"model_n{n_tokens}_s{n_attend}{self._rows_suffix(rows)}", specs, outputs, body)

    def _greedy_tokens(self, logits: HloValue) -> HloValue:
        """s32[b, 1]: the most likely token of each line (across the replicas' vocabulary blocks)."""
        if self.tp_degree == 1:
            tokens = sampling.greedy(logits)
        else:
            start = replica.block_start(logits.scribe, self.vocab_shard)
            tokens = sampling.greedy_sharded(logits, start, self.lowering.replica_groups)
        return reshape(tokens, (logits.dims[0], 1))

    def greedy(self) -> Program:
        b, v = self.batch_size, self.vocab_shard
        return self._program("greedy", [ParamSpec("logits", "f32", (b, v))], ["tokens"],
                             lambda p: {"tokens": self._greedy_tokens(p["logits"])})

    def sampler(self, k_max: int) -> Program:
        b, v = self.batch_size, self.vocab_shard
        specs = [ParamSpec("logits", "f32", (b, v)), ParamSpec("top_k", "s32", (b,)),
                 ParamSpec("top_p", "f32", (b,)), ParamSpec("temperature", "f32", (b,)),
                 ParamSpec("rng_state", "u32", (2, 2))]

        def body(p):
            logits, settings = p["logits"], (p["top_k"], p["top_p"], p["temperature"], p["rng_state"])
            if self.tp_degree == 1:
                tokens, state = sampling.sample(logits, *settings, k_max=k_max)
            else:
                first = replica.block_start(logits.scribe, v)
                tokens, state = sampling.sample_sharded(logits, first, *settings, k_max=k_max,
                                                        replica_groups=self.lowering.replica_groups)
            state.set_alias_to(p["rng_state"])
            return {"tokens": reshape(tokens, (b, 1)), "rng_state": state}

        return self._program(f"sample_k{k_max}", specs, ["tokens", "rng_state"], body)
