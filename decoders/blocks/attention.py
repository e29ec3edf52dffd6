"""Attention piece: fused (per head or contiguous) or split QKV (optional biases), optional
per-head norms of queries and keys (Qwen3, Gemma 3), rotary (full, partial, interleaved) or
ALiBi positions, optional sliding window, grouped-query heads, optional score scale and
soft-capping (Gemma), over an in-place KV cache.

Caches are [batch, kv_heads, n_positions, head_dim]; each step writes its new keys and
values at `step.slot` (one in-place update for the whole batch) and attends over the first
`step.n_attend` slots, masking each line's left padding and the future. A quantized cache
(`kv_quant`) holds each slot's key (value) of each head as a packed int8 row, head_dim
values and the 4 bytes of their f32 scale (pyhlo.ops.quantized.quantize_rows).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from decoders.blocks.norm import Norm
from decoders.blocks.params import Kind, Param, Shard, Source, Transform, per_head_qkv, rows, transposed
from decoders.blocks.step import Step
from decoders.blocks.values import PieceValues
from decoders.parallel import replica
from decoders.parallel.kv_sharding import KVSharding, device_heads
from pyhlo.ops import elementwise as ew
from pyhlo.ops import nn
from pyhlo.ops.attention import attention, combine_attention_parts, partial_attention
from pyhlo.ops.collectives import all_gather
from pyhlo.ops.quantized import SCALE_BYTES, dequantize_rows, quantize_rows
from pyhlo.ops.shape_ops import (
    broadcast,
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
from pyhlo.scribe import HloValue

# Key and value types a cache holds as their bits (u16): Attention.cache_dtype.
HALF_FLOATS = ("bf16", "f16")


@dataclass(frozen=True)
class Rotary:
    """Rotary positions on the first `rotary_dim` features of every head (all of them unless
    partial, as GPT-NeoX and GPT-J), paired "half" (Llama, NeoX) or "interleaved" (GPT-J).

    LongRoPE (Phi-3.5, Phi-4-mini) gives two sets of frequencies: `inv_freq` for a model of at
    most `original_context` positions, `long_inv_freq` for a longer one (for_context() picks
    one by the model's n_positions, as llama.cpp does by its context size), and scales cos and
    sin by `scale`, its attention factor."""

    inv_freq: tuple[float, ...]
    style: str = "half"
    scale: float = 1.0
    long_inv_freq: tuple[float, ...] = ()
    original_context: int = 0

    def __post_init__(self) -> None:
        long_ones = len(self.long_inv_freq)
        if long_ones and (long_ones != len(self.inv_freq) or self.original_context < 1):
            raise ValueError(f"long_inv_freq needs as many frequencies as inv_freq ({len(self.inv_freq)}), "
                             f"got {long_ones}, and an original_context >= 1")

    @property
    def rotary_dim(self) -> int:
        return 2 * len(self.inv_freq)

    def for_context(self, n_positions: int) -> Rotary:
        """The frequencies a model of `n_positions` positions runs with (LongRoPE's long ones
        past the original context); one set from then on."""
        if not self.long_inv_freq:
            return self
        chosen = self.long_inv_freq if n_positions > self.original_context else self.inv_freq
        return replace(self, inv_freq=chosen, long_inv_freq=(), original_context=0)


@dataclass(frozen=True)
class Alibi:
    """ALiBi (Bloom): a bias slope[h] * key position added to the scores; no rotary."""


@dataclass(frozen=True)
class Attention:
    """Checkpoint prefixes ({i}: layer): `q`, `k`, `v` for split projections (Llama), or `qkv`
    for one fused projection, laid out along `out` per head as [head, (q, k, v), head_dim]
    (GPT-NeoX, Bloom) or contiguous as [q | k | v] (GPT-2's c_attn); `out` the output."""

    out: str
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    q: str | None = None
    k: str | None = None
    v: str | None = None
    qkv: str | None = None
    qkv_bias: bool = False
    out_bias: bool = False
    positions: Rotary | Alibi | None = None
    window: int | None = None
    # Per-head norms of queries and keys (Qwen3, Gemma 3): Norms of width head_dim, each over
    # every head's features, after the projection and before the rotary positions.
    q_norm: Norm | None = None
    k_norm: Norm | None = None
    # The program takes q, k and v as one fused weight (NeuronConfig.fuse_qkv) or three.
    fused: bool = True
    qkv_layout: str = "per_head"       # a fused checkpoint qkv: "per_head" | "contiguous"
    # Linear weights stored [in, out] (GPT-2's Conv1D), transposed on reading.
    stored_in_out: bool = False
    # One device's share under tensor parallelism: n_heads (and n_kv_heads, or one replicated
    # KV head) of this many devices' worth; declarations (params) are the whole model's.
    tp_degree: int = 1
    # The whole model's query heads, padding heads left out (ALiBi's slopes are theirs).
    total_heads: int = 0
    # The whole model's KV heads.
    total_kv_heads: int = 0
    # How a device of tensor parallelism holds keys and values (sharded(); decided by
    # decoders/parallel/kv_sharding.py): its KV heads, its batch lines, K and V gathered by
    # features, or its stretch of cache slots.
    kv_sharding: KVSharding = KVSharding.HEADS
    # KV caches of packed int8 rows, one scale per line, head and slot (NeuronConfig.kv_cache_quant).
    kv_quant: bool = False
    # The caches' element type when it differs from the amp type (NeuronConfig.kv_cache_dtype):
    # keys and values are converted as they are written, and back as attention reads them.
    cache_type: str | None = None
    # Scores q.k times this; None: 1 / sqrt(head_dim) (Gemma: query_pre_attn_scalar ** -0.5).
    scores_scale: float | None = None
    # Scaled scores soft-capped, softcap * tanh(scores / softcap) (Gemma 2's attn_logit_softcapping).
    softcap: float | None = None

    def __post_init__(self) -> None:
        if (self.qkv is None) == (self.q is None or self.k is None or self.v is None):
            raise ValueError("Attention needs either q, k and v, or qkv (a fused projection)")
        if self.attending_heads % self.n_kv_heads:
            raise ValueError(f"{self.n_heads} attention heads are not a multiple of {self.n_kv_heads} kv "
                             "heads")
        if self.qkv_layout not in ("per_head", "contiguous"):
            raise ValueError(f"qkv_layout must be 'per_head' or 'contiguous', got {self.qkv_layout!r}")
        if (self.qkv is not None and self.qkv_layout == "per_head" and self.n_kv_heads != self.attending_heads
                and self.kv_sharding is not KVSharding.GATHER):
            raise ValueError("a per-head fused qkv projection has as many kv heads as heads")
        if self.stored_in_out and self.qkv is None and self.fused:
            # Source concatenates parts along axis 0, which is `in` for [in, out] tensors.
            raise ValueError("split q, k, v weights stored [in, out] cannot be fused; use fused=False")
        for head_norm in (self.q_norm, self.k_norm):
            if head_norm is not None and head_norm.width != self.head_dim:
                raise ValueError(f"a per-head q or k norm has width head_dim {self.head_dim}, got "
                                 f"{head_norm.width}")
        if isinstance(self.positions, Rotary) and not 0 < self.positions.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary dimension {self.positions.rotary_dim} must be in 1..head_dim "
                             f"{self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def attending_heads(self) -> int:
        """The query heads this device's attention runs over: every head in the batch and
        sequence layouts (which trade heads for lines or slots), else its own."""
        return self.n_heads if self.kv_sharding.whole_lines else self.n_heads * self.tp_degree

    @property
    def kv_width(self) -> int:
        """Features of K (and of V) out of this device's projection."""
        if self.kv_sharding is KVSharding.GATHER:
            return -(-self.total_kv_heads * self.head_dim // self.tp_degree)
        return self.kv_size

    def cache_dims(self, batch_size: int, cache_len: int) -> tuple[int, int, int, int]:
        """This device's KV cache of one layer: [lines, KV heads, slots, head_dim]."""
        if self.kv_sharding is KVSharding.BATCH and batch_size % self.tp_degree:
            raise ValueError(f"GQA.SHARD_OVER_BATCH splits the caches by batch line, and tp_degree "
                             f"{self.tp_degree} does not divide batch_size {batch_size}; use a batch size "
                             "that it divides, or another strategy")
        if self.kv_sharding is KVSharding.SEQUENCE and cache_len % self.tp_degree:
            raise ValueError(f"shard_over_sequence splits the caches by slot, and tp_degree {self.tp_degree} "
                             f"does not divide n_positions {cache_len}; use an n_positions that it divides")
        lines = batch_size // self.tp_degree if self.kv_sharding is KVSharding.BATCH else batch_size
        slots = cache_len // self.tp_degree if self.kv_sharding is KVSharding.SEQUENCE else cache_len
        return lines, self.n_kv_heads, slots, self.head_dim + (SCALE_BYTES if self.kv_quant else 0)

    def cache_values_dtype(self, amp: str) -> str:
        """The type of the keys and values a cache holds: the amp type, cache_type, or s8 for
        packed int8 rows."""
        return "s8" if self.kv_quant else self.cache_type or amp

    def cache_dtype(self, amp: str) -> str:
        """The caches' element type: their values' type (cache_values_dtype), but u16 for
        values in bf16 or f16, which a cache holds as their bits (_to_cache)."""
        values = self.cache_values_dtype(amp)
        return "u16" if values in HALF_FLOATS else values

    def _to_cache(self, t: HloValue) -> HloValue:
        """Keys or values [b, heads, n, head_dim] as the cache stores them.

        A 16-bit float cache holds the values' bits (u16): XLA:CPU widens a bf16 update or slice
        of a cache to f32 (converting the whole cache and back at every step), and an update
        whose result is then bitcast back to bf16 is no longer done in place (the program
        rewrites the whole cache to move one slot). As u16 every write is one in-place update."""
        if self.kv_quant:
            return quantize_rows(t)
        stored = self.cache_type or t.dtype
        return _as_bits(ew.convert(t, stored) if stored != t.dtype else t)

    def _from_cache(self, cache: HloValue, dtype: str) -> HloValue:
        """Cache rows as keys or values in `dtype` (the amp type)."""
        if self.kv_quant:
            return dequantize_rows(cache, dtype)
        if cache.dtype == "u16":
            cache = ew.bitcast_convert(cache, self.cache_type or dtype)
        return ew.convert(cache, dtype) if cache.dtype != dtype else cache

    @property
    def scale(self) -> float:
        return 1.0 / float(np.sqrt(self.head_dim)) if self.scores_scale is None else self.scores_scale

    @property
    def plain(self) -> bool:
        """Softmax(scale q k) v with only the causal, padding and window masks (no bias, no
        soft-capping): what a lowering's decode attention takes, a window narrowing the slots
        each line reads (window_pad)."""
        return not isinstance(self.positions, Alibi) and self.softcap is None

    def window_pad(self, slot: HloValue, pad: HloValue) -> HloValue:
        """s32[b]: the first slot a decode step's query at slot[i] sees, pad[i] or, with a
        window, the oldest slot within it (slot - window + 1), whichever is later."""
        if self.window is None:
            return pad
        return ew.maximum(pad, ew.subtract(slot, self.window - 1))

    # -- parameters -----------------------------------------------------------------
    def _stored(self, suffix: str) -> tuple[Transform, ...]:
        """Transforms from a stored weight or bias to its [out, in] or [out] form."""
        return (transposed(),) if self.stored_in_out and suffix == "weight" else ()

    def _fused_qkv(self, suffix: str) -> Source:
        """The checkpoint's fused qkv (weight or bias) as [q | k | v, ...]."""
        reorder = (per_head_qkv(self.n_heads, self.head_dim),) if self.qkv_layout == "per_head" else ()
        return Source((f"{self.qkv}.{suffix}",), self._stored(suffix) + reorder)

    def _sources(self, suffix: str) -> dict[str, Source]:
        """Checkpoint sources of q, k and v (weights or biases), in q|k|v order."""
        if self.qkv is None:
            return {part: Source((f"{getattr(self, part)}.{suffix}",), self._stored(suffix))
                    for part in "qkv"}
        fused = self._fused_qkv(suffix)
        bounds = {"q": (0, self.q_size), "k": (self.q_size, self.q_size + self.kv_size),
                  "v": (self.q_size + self.kv_size, self.q_size + 2 * self.kv_size)}
        return {part: Source(fused.names, (*fused.transforms, rows(*bounds[part]))) for part in bounds}

    def _qkv_params(self, scope: str, suffix: str) -> list[Param]:
        kind = Kind.LINEAR if suffix == "weight" else Kind.VECTOR
        trailing = (self.hidden,) if suffix == "weight" else ()
        sizes = {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}
        sources = self._sources(suffix)
        if not self.fused:
            return [Param(f"{scope}.{part}.{suffix}", kind, (sizes[part], *trailing), Shard.COLUMN,
                          sources[part],
                          unit=self.head_dim, head_groups=self.n_kv_heads,
                          kv_segments=() if part == "q" else (0,))
                    for part in ("q", "k", "v")]
        if self.qkv is None:
            source = Source(tuple(sources[part].names[0] for part in ("q", "k", "v")))
        else:
            source = self._fused_qkv(suffix)
        return [Param(f"{scope}.qkv.{suffix}", kind, (sum(sizes.values()), *trailing), Shard.COLUMN, source,
                      segments=tuple(sizes.values()), unit=self.head_dim, head_groups=self.n_kv_heads,
                      kv_segments=(1, 2))]

    def params(self, scope: str) -> list[Param]:
        declared = self._qkv_params(scope, "weight")
        if self.qkv_bias:
            declared += self._qkv_params(scope, "bias")
        for name, head_norm in (("q_norm", self.q_norm), ("k_norm", self.k_norm)):
            if head_norm is not None:
                declared += head_norm.params(f"{scope}.{name}")
        declared.append(Param(f"{scope}.out.weight", Kind.LINEAR, (self.hidden, self.q_size), Shard.ROW,
                              Source((f"{self.out}.weight",), self._stored("weight")), unit=self.head_dim,
                              head_groups=self.n_kv_heads))
        if self.out_bias:
            declared.append(Param(f"{scope}.out.bias", Kind.VECTOR, (self.hidden,), Shard.REPLICATED,
                                  Source((f"{self.out}.bias",))))
        return declared

    # -- the program ------------------------------------------------------------------
    def __call__(self, values: PieceValues, x: HloValue, step: Step, cache_k: HloValue,
                 cache_v: HloValue) -> tuple[HloValue, HloValue, HloValue]:
        """Attention output [b, n, hidden], and both caches with this step's keys and values."""
        b, n = step.batch_size, step.n_tokens
        q, k, v = self._project(values, x)
        if self.kv_sharding is KVSharding.GATHER:
            k, v = self._own_kv_heads(k), self._own_kv_heads(v)
        q = reshape(q, (b, n, self.n_heads, self.head_dim))
        k = reshape(k, (b, n, self.n_kv_heads, self.head_dim))
        v = reshape(v, (b, n, self.n_kv_heads, self.head_dim))
        if self.q_norm is not None:
            q = self.q_norm(values.scoped("q_norm", self.q_norm), q)
        if self.k_norm is not None:
            k = self.k_norm(values.scoped("k_norm", self.k_norm), k)
        if isinstance(self.positions, Rotary):
            q, k = self._rotate(q, k, step.positions, values.lowering)
        q, k, v = (transpose(t, (0, 2, 1, 3)) for t in (q, k, v))     # [b, heads, n, d]
        if self.kv_sharding is KVSharding.SEQUENCE:
            context, cache_k, cache_v = self._attend_stretch(q, k, v, step, cache_k, cache_v)
        elif self.kv_sharding is KVSharding.BATCH:
            # Heads for lines: every query head of this device's lines, over its caches; then back.
            lines = b // self.tp_degree
            q = replica.exchange(q, 1, 0, self.tp_degree)
            k, v = replica.own_block(k, 0, lines), replica.own_block(v, 0, lines)
            slot = replica.own_block(step.slot, 0, lines) if step.per_line else step.slot
            step = Step(replica.own_block(step.positions, 0, lines), slot,
                        replica.own_block(step.pad, 0, lines), step.n_tokens, step.n_attend)
            context, cache_k, cache_v = self._attend_here(values, q, k, v, step, cache_k, cache_v)
            context = replica.exchange(context, 0, 1, self.tp_degree)
        else:
            context, cache_k, cache_v = self._attend_here(values, q, k, v, step, cache_k, cache_v)
        context = ew.convert(reshape(transpose(context, (0, 2, 1, 3)), (b, n, self.q_size)), x.dtype)
        return values.linear(context, "out"), cache_k, cache_v

    def _attend_here(self, values: PieceValues, q: HloValue, k: HloValue, v: HloValue, step: Step,
                     cache_k: HloValue, cache_v: HloValue) -> tuple[HloValue, HloValue, HloValue]:
        """Attention over caches that hold every slot of their lines: this step's keys and
        values written at step.slot, then the lowering's decode attention or the generic one."""
        cache_k = self._write(cache_k, self._to_cache(k), step)
        cache_v = self._write(cache_v, self._to_cache(v), step)
        context = None
        if self.plain:
            # Continuous batching's programs for some of the lines read each row's own line.
            slots = step.line_slots()
            if step.n_tokens == 1:
                context = values.lowering.decode_attention(q, cache_k, cache_v, slots,
                                                           self.window_pad(slots, step.pad), self.scale,
                                                           step.lines)
            else:
                context = values.lowering.prefill_attention(q, cache_k, cache_v, slots, step.pad, self.scale,
                                                            step.lines, self.window)
        if context is None:
            context = self._attend(q, cache_k, cache_v, step, values.lowering.attention_in_conditional)
        return context, cache_k, cache_v

    @staticmethod
    def _write(cache: HloValue, new: HloValue, step: Step) -> HloValue:
        """The cache with new [b, heads, n, d] written at the step's slot: one in-place update
        for the batch, or one per line at its own slot (continuous batching)."""
        if not step.per_line:
            cache = dynamic_update_slice(cache, new, [0, 0, step.slot, 0])
        else:
            for row in range(step.batch_size):
                cache = dynamic_update_slice(cache, slice_along(new, 0, row, row + 1),
                                             [step.cache_line(row), 0, step.line_slot(row), 0])
        return cache

    def _attend_stretch(self, q: HloValue, k: HloValue, v: HloValue, step: Step, cache_k: HloValue,
                        cache_v: HloValue) -> tuple[HloValue, HloValue, HloValue]:
        """Flash decoding: this device's caches hold slots first .. first + L - 1 of every line
        and KV head. Every query head attends over them (partial softmax statistics), the
        replicas combine their parts, and each keeps its own query heads' outputs."""
        tp, length = self.tp_degree, cache_k.dims[2]
        q = all_gather(q, 1, replica.group(tp))
        first = replica.block_start(q.scribe, length)
        cache_k = replica.write_stretch(cache_k, self._to_cache(k), step.slot, first)
        cache_v = replica.write_stretch(cache_v, self._to_cache(v), step.slot, first)
        bias = self._alibi(step, first, length) if isinstance(self.positions, Alibi) else None
        keys, values = self._from_cache(cache_k, q.dtype), self._from_cache(cache_v, q.dtype)
        parts = partial_attention(q, keys, values, self._mask(step, first, length), self.scale, bias,
                                  self.softcap)
        context = combine_attention_parts(*parts, replica.group(tp))
        return replica.own_block(ew.convert(context, q.dtype), 1, self.n_heads), cache_k, cache_v

    def _own_kv_heads(self, projected: HloValue) -> HloValue:
        """GQA.ALL_GATHER_HEADS: this device's features of K (or V) [b, n, kv_width], gathered
        from every device, narrowed to the KV heads of this device's query heads."""
        b, n, _ = projected.dims
        everything = all_gather(projected, 2, replica.group(self.tp_degree))
        group = self.total_heads // self.total_kv_heads
        first = ew.divide(replica.block_start(projected.scribe, self.n_heads), group)
        return dynamic_slice(everything, [0, 0, ew.multiply(first, self.head_dim)], [b, n, self.kv_size])

    def _project(self, values: PieceValues, x: HloValue) -> tuple[HloValue, HloValue, HloValue]:
        if not self.fused:
            return values.linear(x, "q"), values.linear(x, "k"), values.linear(x, "v")
        qkv = values.linear(x, "qkv")
        last = len(qkv.dims) - 1
        q_end, k_end = self.q_size, self.q_size + self.kv_width
        return (slice_along(qkv, last, 0, q_end), slice_along(qkv, last, q_end, k_end),
                slice_along(qkv, last, k_end, k_end + self.kv_width))

    def _rotate(self, q: HloValue, k: HloValue, positions: HloValue, lowering) -> tuple[HloValue, HloValue]:
        rotary = self.positions
        cos, sin = lowering.rotary_cos_sin(positions, np.asarray(rotary.inv_freq, np.float32), rotary.style)
        if rotary.scale != 1.0:
            cos, sin = ew.multiply(cos, rotary.scale), ew.multiply(sin, rotary.scale)
        b, n = positions.dims

        def spread(table: HloValue, heads: int) -> HloValue:
            return broadcast(table, (b, n, heads, rotary.rotary_dim), [0, 1, 3])

        rotated = []
        for t, heads in ((q, self.n_heads), (k, self.n_kv_heads)):
            rotated.append(nn.apply_rotary_partial(t, spread(cos, heads), spread(sin, heads),
                                                   rotary.rotary_dim, rotary.style))
        return rotated[0], rotated[1]

    def _mask(self, step: Step, first: HloValue | None = None, n_keys: int | None = None) -> HloValue:
        """Query j of line i sees key slots pad[i] <= k <= slot + j (and within the window),
        over slots 0 .. n_attend - 1, or the n_keys slots from `first` (flash decoding)."""
        b, n, s = step.batch_size, step.n_tokens, n_keys or step.n_attend
        scribe = step.slot.scribe
        start = step.slot if first is None else ew.subtract(step.slot, first)
        starts = broadcast(start, (b, n), [0]) if step.per_line else ew.broadcast_scalar(start, (b, n))
        query_slots = ew.add(iota(scribe, "s32", (b, n), 1), starts)
        causal = nn.causal_mask(query_slots, s, self.window)    # in slots counted from `first`
        key_slots = self._key_slots(scribe, (b, n, s), 2, first)
        return scribe.pred[b, n, s].And(causal,
                                        ew.compare(key_slots, broadcast(step.pad, (b, n, s), [0]), "GE"))

    @staticmethod
    def _key_slots(scribe, dims: tuple[int, ...], dim: int, first: HloValue | None) -> HloValue:
        slots = iota(scribe, "s32", dims, dim)
        return slots if first is None else ew.add(slots, ew.broadcast_scalar(first, dims))

    def _alibi(self, step: Step, first: HloValue | None = None, n_keys: int | None = None) -> HloValue:
        """f32[b, heads, n, s]: slope[h] * (key slot - pad[b]), key positions as HF Bloom counts
        them; keys as _mask() takes them. Heads: this device's, or every head where attention
        runs over all of them (the batch and sequence layouts)."""
        b, n, s = step.batch_size, step.n_tokens, n_keys or step.n_attend
        scribe = step.slot.scribe
        heads = self.attending_heads
        all_heads = heads > self.n_heads
        dims = (b, heads, n, s)
        everyone = np.zeros(self.n_heads * self.tp_degree, np.float32)      # padding heads: 0
        real = nn.alibi_slopes(self.total_heads or len(everyone))
        everyone[: len(real)] = real
        slopes = ew.constant(scribe, "f32", everyone, everyone.shape)
        if self.tp_degree > 1 and not all_heads:
            # This replica's heads: a block of the whole model's, picked by its replica id.
            slopes = replica.own_block(slopes, 0, self.n_heads)
        key_slots = ew.convert(self._key_slots(scribe, dims, 3, first), "f32")
        key_positions = ew.subtract(key_slots, broadcast(ew.convert(step.pad, "f32"), dims, [0]))
        return ew.multiply(broadcast(slopes, dims, [1]), key_positions)

    def for_context(self, n_positions: int) -> Attention:
        """This attention in a model of `n_positions` positions (Rotary.for_context)."""
        if not isinstance(self.positions, Rotary):
            return self
        return replace(self, positions=self.positions.for_context(n_positions))

    def sharded(self, tp_degree: int, kv_sharding: KVSharding = KVSharding.HEADS) -> Attention:
        """One device's share over `tp_degree` devices (as decoders/parallel/sharding.py splits
        the weights) under `kv_sharding` (decided by decoders/parallel/kv_sharding.py): its
        query and KV heads; declarations (params) stay the whole model's."""
        if tp_degree == 1:
            return self
        heads = device_heads(self, tp_degree, kv_sharding)
        return replace(self, n_heads=heads.n_heads, n_kv_heads=heads.n_kv_heads, tp_degree=tp_degree,
                       total_heads=self.n_heads, total_kv_heads=self.n_kv_heads, kv_sharding=kv_sharding)

    @staticmethod
    def _rows_of(cache: HloValue, lines: HloValue, n_attend: int) -> HloValue:
        """cache [lines, heads, slots, d] -> [rows, heads, n_attend, d]: row i's line lines[i]."""
        _, heads, _, d = cache.dims
        parts = [dynamic_slice(cache, [reshape(slice_along(lines, 0, i, i + 1), ()), 0, 0, 0],
                               [1, heads, n_attend, d]) for i in range(lines.dims[0])]
        return parts[0] if len(parts) == 1 else concatenate(parts, 0)

    def _attend(self, q: HloValue, cache_k: HloValue, cache_v: HloValue, step: Step,
                in_conditional: bool = True) -> HloValue:
        """Attention over the first n_attend slots of the just-updated caches.

        Reading an updated cache directly (sliced, or reshaped at batch 1) lets XLA:CPU fuse
        the update into that read and then copy the whole cache to keep the old value alive.
        Inside a conditional (whose branch index is only known at run time) the slice reads
        the updated buffer, so the update stays in place. Both branches are the same.
        `in_conditional` False reads the caches directly (the lowering's choice).
        """
        operands = [q, cache_k, cache_v, self._mask(step)]
        if isinstance(self.positions, Alibi):
            operands.append(self._alibi(step))
        if step.lines is not None:
            operands.append(step.lines)
        n_attend, cache_len = step.n_attend, cache_k.dims[2]

        def attend_prefix(q_, k_, v_, mask_, *rest):
            rest = list(rest)
            if step.lines is not None:
                # Rows of some lines: each row's own line of the caches, its first n_attend slots.
                lines_ = rest.pop()
                k_, v_ = (self._rows_of(c, lines_, n_attend) for c in (k_, v_))
            elif n_attend < cache_len:
                k_, v_ = slice_along(k_, 2, 0, n_attend), slice_along(v_, 2, 0, n_attend)
            bias = rest
            k_, v_ = self._from_cache(k_, q_.dtype), self._from_cache(v_, q_.dtype)
            return attention(q_, k_, v_, mask_, self.scale, bias=bias[0] if bias else None,
                             softcap=self.softcap)

        if not in_conditional:
            return attend_prefix(*operands)

        def branch(scribe):
            packed = scribe.tuple(*(o.shape for o in operands)).Parameter(parameter_number=0)
            return attend_prefix(*(get_tuple_element(packed, i) for i in range(len(operands))))

        packed = make_tuple(*operands)
        return q.shape.Conditional(step.line_slot(0), packed, packed, branch_computations=[branch, branch])


def _as_bits(t: HloValue) -> HloValue:
    """A 16-bit float value as its bits (u16), as a cache holds it; others as they are."""
    return ew.bitcast_convert(t, "u16") if t.dtype in HALF_FLOATS else t
