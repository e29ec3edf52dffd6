"""The PyHLO programs of a decoder LLM, built from a family description.

Each program declares its parameters as named specs (`ParamSpec`), so callers
pass arguments by name and never keep a positional order by hand:

- embed:   token ids -> hidden states
- block:   one decoder layer (reused by every layer with that layer's weights);
           writes the new keys/values into the KV cache in place (aliased) and
           attends over the first `n_attend` cache slots

Batch lines are left-padded: every line writes the same cache slot at each step
(one in-place update for the whole batch), line i's real tokens start at slot
`pad[i]`, and its rotary positions count from its first real token.
- lm_head: final norm + vocabulary projection of one position per batch line
- greedy / sample: the next token of every batch line, on the device
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from decoders.config import NotSupportedYet
from decoders.family import DecoderFamily, ModelDims
from pyhlo import Scribe, compile_py_func
from pyhlo.ops import elementwise as ew
from pyhlo.ops import nn, sampling
from pyhlo.ops.attention import attention, decode_attention_kernel
from pyhlo.ops.linalg import matmul, matmul_transposed, matvec_kernel
from pyhlo.ops.shape_ops import (
    concatenate,
    dynamic_slice,
    dynamic_update_slice,
    get_tuple_element,
    iota,
    make_tuple,
    reshape,
    slice_along,
    transpose,
)
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


def _declare(scribe: Scribe, specs: list[ParamSpec]) -> dict[str, HloValue]:
    return {
        spec.name: getattr(scribe, spec.dtype)[spec.dims].Parameter(parameter_number=i, parameter_name=spec.name)
        for i, spec in enumerate(specs)
    }


def _program(name: str, specs: list[ParamSpec], outputs: list[str], body) -> Program:
    """Write a module whose entry takes `specs` and returns body(params) as named outputs."""

    def entry(scribe: Scribe):
        params = _declare(scribe, specs)
        results = body(params)
        return [results[o] for o in outputs]

    entry.__name__ = name
    return Program(name, compile_py_func(entry, name=name), tuple(specs), tuple(outputs))


# Up to this many activation rows (by weight type) a product is bound by reading the
# weights and the kernel, reading them once for all rows, beats XLA's dot; beyond it
# XLA's matrix-matrix dot is faster (measured on a [49152, 576] head: f32 1.5x faster
# at 1 row, 1.5x at 4, slower at 8; bf16 20x at 1 row, 2.7x at 2, 1.5x at 4).
MATVEC_KERNEL_MAX_ROWS = {"f32": 4, "bf16": 4}


@dataclass(frozen=True)
class GraphBuilder:
    family: DecoderFamily
    dims: ModelDims
    batch_size: int
    cache_len: int          # n_positions: every layer's cache holds this many positions
    dtype: str              # amp element type of weights, activations and caches
    # "in_out": linear weights [in, out] and the LM head [hidden, vocab];
    # "out_in": torch's own [out, in] and [vocab, hidden]. Which streams faster through
    # XLA:CPU's matrix-vector products depends on the element type and the batch size.
    weight_layout: str = "in_out"
    # The LM head's element type: f32 unless the products below make the amp type fast.
    head_dtype: str = "f32"
    # XLA:CPU only: pyhlo's kernels (runtime/kernels/), called through typed-FFI custom
    # calls. Products with few activation rows (MATVEC_KERNEL_MAX_ROWS: decode steps at
    # small batch sizes) run on the matrix-vector kernel, longer ones (prefill) stay XLA
    # dots; decode attention reads the cache in place.
    cpu_kernels: bool = False

    def __post_init__(self) -> None:
        if self.weight_layout not in ("in_out", "out_in"):
            raise ValueError(f"weight_layout must be 'in_out' or 'out_in', got {self.weight_layout!r}")
        if self.cpu_kernels and (self.weight_layout != "out_in" or self.dtype not in ("f32", "bf16")
                                   or self.head_dtype not in ("f32", "bf16")):
            raise ValueError("cpu_kernels needs weight_layout='out_in' and f32 or bf16 weights, got "
                             f"{self.weight_layout!r} and {self.dtype}/{self.head_dtype}")
        built = {"norm": "rms", "activation": "silu", "gated_mlp": True, "positions": "rope", "qkv_bias": False}
        for name, value in built.items():
            if getattr(self.family, name) != value:
                raise NotSupportedYet(
                    f"family {self.family.name!r}: {name}={getattr(self.family, name)!r} is not built yet "
                    f"(the shared block has {name}={value!r})"
                )

    @property
    def shares_one_table(self) -> bool:
        """Tied embeddings stored once: the LM head table also serves the embedding."""
        return self.dims.tie_word_embeddings and self.head_dtype == self.dtype

    def _weight(self, name: str, n_in: int, n_out: int, dtype: str | None = None) -> ParamSpec:
        dims = (n_in, n_out) if self.weight_layout == "in_out" else (n_out, n_in)
        return ParamSpec(name, dtype or self.dtype, dims)

    def _linear(self, x: HloValue, weight: HloValue, out_dtype: str | None = None) -> HloValue:
        """x @ weight. bf16/f16 products accumulate into f32 (XLA:CPU's fast form for
        them, and the accurate one), then return to the activation type."""
        if self.cpu_kernels and int(np.prod(x.dims[:-1])) <= MATVEC_KERNEL_MAX_ROWS[weight.dtype]:
            return ew.convert(matvec_kernel(ew.convert(x, "f32"), weight), out_dtype or x.dtype)
        accumulate = "f32" if weight.dtype != "f32" else None
        product = (matmul if self.weight_layout == "in_out" else matmul_transposed)(
            ew.convert(x, weight.dtype), weight, out_dtype=out_dtype or accumulate)
        return ew.convert(product, out_dtype or x.dtype)

    # -- weight specs ------------------------------------------------------
    def layer_weight_specs(self) -> list[ParamSpec]:
        d, t = self.dims, self.dtype
        return [
            ParamSpec("input_norm", t, (d.hidden_size,)),
            self._weight("qkv_weight", d.hidden_size, d.q_size + 2 * d.kv_size),
            self._weight("o_weight", d.q_size, d.hidden_size),
            ParamSpec("post_norm", t, (d.hidden_size,)),
            self._weight("gate_up_weight", d.hidden_size, 2 * d.intermediate_size),
            self._weight("down_weight", d.intermediate_size, d.hidden_size),
        ]

    def cache_spec(self, name: str) -> ParamSpec:
        d = self.dims
        return ParamSpec(name, self.dtype, (self.batch_size, d.n_kv_heads, self.cache_len, d.head_dim))

    # -- programs -------------------------------------------------------------
    def embed_table_spec(self) -> ParamSpec:
        """The table the embed program reads: the LM head itself when tied embeddings share it."""
        d = self.dims
        if not self.shares_one_table:
            return ParamSpec("embed_weight", self.dtype, (d.vocab_size, d.hidden_size))
        return self._weight("lm_head_weight", d.hidden_size, d.vocab_size, self.head_dtype)

    def embed(self, n_tokens: int) -> Program:
        specs = [ParamSpec("token_ids", "s32", (self.batch_size, n_tokens)), self.embed_table_spec()]
        return _program(f"embed_n{n_tokens}", specs, ["hidden"], lambda p: self._embed(p, n_tokens))

    def _embed(self, p: dict[str, HloValue], n_tokens: int) -> dict[str, HloValue]:
        """Rows of the [vocab, hidden] table, or columns of a [hidden, vocab] LM head."""
        d, b = self.dims, self.batch_size
        spec = self.embed_table_spec()
        table, ids = p[spec.name], p["token_ids"]
        shape = getattr(table.scribe, self.dtype)
        if spec.dims == (d.hidden_size, d.vocab_size):
            numbers = dict(offset_dims=[0], collapsed_slice_dims=[1], start_index_map=[1], index_vector_dim=2)
            columns = shape[d.hidden_size, b, n_tokens].Gather(
                table, ids, gather_dimension_numbers=numbers, gather_slice_sizes=[d.hidden_size, 1])
            return {"hidden": transpose(columns, (1, 2, 0))}
        numbers = dict(offset_dims=[2], collapsed_slice_dims=[0], start_index_map=[0], index_vector_dim=2)
        hidden = shape[b, n_tokens, d.hidden_size].Gather(
            table, ids, gather_dimension_numbers=numbers, gather_slice_sizes=[1, d.hidden_size])
        return {"hidden": hidden}

    def block(self, n_tokens: int, n_attend: int) -> Program:
        """One decoder layer over `n_tokens` new tokens per line, attending to `n_attend` keys."""
        d, b, t = self.dims, self.batch_size, self.dtype
        specs = [ParamSpec("hidden", t, (b, n_tokens, d.hidden_size)),
                 ParamSpec("positions", "s32", (b, n_tokens)),
                 ParamSpec("slot", "s32", ()),
                 ParamSpec("pad", "s32", (b,)),
                 self.cache_spec("cache_k"), self.cache_spec("cache_v"),
                 *self.layer_weight_specs()]

        return _program(f"block_n{n_tokens}_s{n_attend}", specs, ["hidden", "cache_k", "cache_v"],
                        lambda p: self._layer(p, n_tokens, n_attend))

    def _layer(self, p: dict[str, HloValue], n_tokens: int, n_attend: int) -> dict[str, HloValue]:
        """One decoder layer on named values: hidden, positions, slot, pad, caches, weights."""
        d, b = self.dims, self.batch_size
        hidden, positions = p["hidden"], p["positions"]
        x = nn.rms_norm(hidden, p["input_norm"], d.norm_eps)
        qkv = self._linear(x, p["qkv_weight"])
        q = reshape(slice_along(qkv, 2, 0, d.q_size), (b, n_tokens, d.n_heads, d.head_dim))
        k = reshape(slice_along(qkv, 2, d.q_size, d.q_size + d.kv_size),
                    (b, n_tokens, d.n_kv_heads, d.head_dim))
        v = reshape(slice_along(qkv, 2, d.q_size + d.kv_size, d.q_size + 2 * d.kv_size),
                    (b, n_tokens, d.n_kv_heads, d.head_dim))
        q, k = self._rotate(q, k, positions)
        q = transpose(q, (0, 2, 1, 3))                      # [b, h, n, d]
        k = transpose(k, (0, 2, 1, 3))                      # [b, kvh, n, d]
        v = transpose(v, (0, 2, 1, 3))
        cache_k = dynamic_update_slice(p["cache_k"], k, [0, 0, p["slot"], 0])
        cache_v = dynamic_update_slice(p["cache_v"], v, [0, 0, p["slot"], 0])
        if self.cpu_kernels and n_tokens == 1:
            context = decode_attention_kernel(ew.convert(q, "f32"), cache_k, cache_v, p["slot"], p["pad"],
                                              d.attention_scale)
        else:
            mask = self._mask(p["slot"], p["pad"], n_tokens, n_attend)
            context = self._attend(q, cache_k, cache_v, mask, n_attend, p["slot"])   # [b, h, n, d]
        context = ew.convert(reshape(transpose(context, (0, 2, 1, 3)), (b, n_tokens, d.q_size)), self.dtype)
        hidden = ew.add(hidden, self._linear(context, p["o_weight"]))
        x = nn.rms_norm(hidden, p["post_norm"], d.norm_eps)
        gate_up = self._linear(x, p["gate_up_weight"])
        gate = slice_along(gate_up, 2, 0, d.intermediate_size)
        up = slice_along(gate_up, 2, d.intermediate_size, 2 * d.intermediate_size)
        mlp = self._linear(ew.multiply(nn.silu(gate), up), p["down_weight"])
        hidden = ew.add(hidden, mlp)
        cache_k.set_alias_to(p["cache_k"], must=True)
        cache_v.set_alias_to(p["cache_v"], must=True)
        return {"hidden": hidden, "cache_k": cache_k, "cache_v": cache_v}

    def head_specs(self) -> list[ParamSpec]:
        d = self.dims
        return [ParamSpec("final_norm", self.dtype, (d.hidden_size,)),
                self._weight("lm_head_weight", d.hidden_size, d.vocab_size, self.head_dtype)]

    def lm_head(self, n_tokens: int) -> Program:
        """Logits (f32) of position `last_index[i]` of each line i."""
        d, b = self.dims, self.batch_size
        specs = [ParamSpec("hidden", self.dtype, (b, n_tokens, d.hidden_size)),
                 ParamSpec("last_index", "s32", (b,)), *self.head_specs()]
        return _program(f"lm_head_n{n_tokens}", specs, ["logits"], lambda p: self._head(p, n_tokens))

    def _head(self, p: dict[str, HloValue], n_tokens: int) -> dict[str, HloValue]:
        d, b = self.dims, self.batch_size
        hidden = p["hidden"]
        if n_tokens == 1:
            rows = reshape(hidden, (b, d.hidden_size))
        else:
            picked = []
            for i in range(b):
                index = reshape(dynamic_slice(p["last_index"], [i], [1]), ())
                picked.append(dynamic_slice(hidden, [i, index, 0], [1, 1, d.hidden_size]))
            rows = reshape(concatenate(picked, 0), (b, d.hidden_size))
        x = nn.rms_norm(rows, p["final_norm"], d.norm_eps)
        return {"logits": self._linear(x, p["lm_head_weight"], out_dtype="f32")}

    def model_step(self, n_tokens: int, n_attend: int) -> Program:
        """The whole model unrolled into one program: token ids -> logits, every layer's
        caches updated in place. Parameters of layer i are named `layer{i}.NAME`."""
        d, b = self.dims, self.batch_size
        per_layer = [self.cache_spec("cache_k"), self.cache_spec("cache_v"), *self.layer_weight_specs()]
        shared = [self.embed_table_spec()] + [s for s in self.head_specs() if s.name != self.embed_table_spec().name]
        specs = [ParamSpec("token_ids", "s32", (b, n_tokens)), ParamSpec("positions", "s32", (b, n_tokens)),
                 ParamSpec("slot", "s32", ()), ParamSpec("pad", "s32", (b,)), ParamSpec("last_index", "s32", (b,)),
                 *shared,
                 *(ParamSpec(f"layer{i}.{spec.name}", spec.dtype, spec.dims)
                   for i in range(d.n_layers) for spec in per_layer)]
        outputs = ["logits"] + [f"layer{i}.{c}" for i in range(d.n_layers) for c in ("cache_k", "cache_v")]

        def body(p):
            hidden = self._embed(p, n_tokens)["hidden"]
            results = {}
            for i in range(d.n_layers):
                layer = {spec.name: p[f"layer{i}.{spec.name}"] for spec in per_layer}
                out = self._layer({**p, **layer, "hidden": hidden}, n_tokens, n_attend)
                hidden = out["hidden"]
                results[f"layer{i}.cache_k"], results[f"layer{i}.cache_v"] = out["cache_k"], out["cache_v"]
            results["logits"] = self._head({**p, "hidden": hidden}, n_tokens)["logits"]
            return results

        return _program(f"model_n{n_tokens}_s{n_attend}", specs, outputs, body)

    def greedy(self) -> Program:
        b, v = self.batch_size, self.dims.vocab_size
        specs = [ParamSpec("logits", "f32", (b, v))]

        def body(p):
            return {"tokens": reshape(sampling.greedy(p["logits"]), (b, 1))}

        return _program("greedy", specs, ["tokens"], body)

    def sampler(self, k_max: int) -> Program:
        b, v = self.batch_size, self.dims.vocab_size
        specs = [ParamSpec("logits", "f32", (b, v)), ParamSpec("top_k", "s32", (b,)),
                 ParamSpec("top_p", "f32", (b,)), ParamSpec("temperature", "f32", (b,)),
                 ParamSpec("rng_state", "u32", (2, 2))]

        def body(p):
            tokens, state = sampling.sample(p["logits"], p["top_k"], p["top_p"], p["temperature"],
                                            p["rng_state"], k_max=k_max)
            state.set_alias_to(p["rng_state"])
            return {"tokens": reshape(tokens, (b, 1)), "rng_state": state}

        return _program(f"sample_k{k_max}", specs, ["tokens", "rng_state"], body)

    # -- pieces of the block -------------------------------------------------
    def _rotate(self, q: HloValue, k: HloValue, positions: HloValue) -> tuple[HloValue, HloValue]:
        d = self.dims
        cos, sin = nn.rotary_cos_sin(positions, np.asarray(d.inv_freq, np.float32), self.family.rope_style)
        b, n = positions.dims

        def spread(table: HloValue, heads: int) -> HloValue:
            shape = table.scribe.f32[b, n, heads, d.head_dim]
            return shape.Broadcast(table, dimensions=[0, 1, 3])

        q = nn.apply_rotary(q, spread(cos, d.n_heads), spread(sin, d.n_heads), self.family.rope_style)
        k = nn.apply_rotary(k, spread(cos, d.n_kv_heads), spread(sin, d.n_kv_heads), self.family.rope_style)
        return q, k

    def _mask(self, slot: HloValue, pad: HloValue, n_tokens: int, n_attend: int) -> HloValue:
        """Query j of line i sees key slots pad[i] <= k <= slot + j."""
        b = self.batch_size
        scribe = slot.scribe
        query_slots = ew.add(iota(scribe, "s32", (b, n_tokens), 1), ew.broadcast_scalar(slot, (b, n_tokens)))
        causal = nn.causal_mask(query_slots, n_attend)
        key_slots = iota(scribe, "s32", (b, n_tokens, n_attend), 2)
        first = scribe.s32[b, n_tokens, n_attend].Broadcast(pad, dimensions=[0])
        real = ew.compare(key_slots, first, "GE")
        return scribe.pred[b, n_tokens, n_attend].And(causal, real)

    def _attend(self, q: HloValue, cache_k: HloValue, cache_v: HloValue, mask: HloValue,
                n_attend: int, selector: HloValue) -> HloValue:
        """Attention over the first n_attend slots of the just-updated caches.

        Reading an updated cache directly (sliced, or reshaped at batch 1) lets XLA fuse
        the update into that read and then copy the whole cache to keep the old value
        alive. Inside a conditional
        (whose branch index is only known at run time) the slice reads the updated
        buffer, so the update stays in place. Both branches are the same computation.
        """
        scale = self.dims.attention_scale

        def attend_prefix(scribe):
            operands = scribe.tuple(q.shape, cache_k.shape, cache_v.shape, mask.shape).Parameter(
                parameter_number=0)
            q_, k_, v_, mask_ = (get_tuple_element(operands, i) for i in range(4))
            if n_attend < self.cache_len:
                k_, v_ = slice_along(k_, 2, 0, n_attend), slice_along(v_, 2, 0, n_attend)
            return attention(q_, k_, v_, mask_, scale)

        operands = make_tuple(q, cache_k, cache_v, mask)
        return q.shape.Conditional(selector, operands, operands,
                                   branch_computations=[attend_prefix, attend_prefix])
