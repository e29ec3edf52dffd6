"""How a platform runs the decoder's products and attention: chosen once per model.

The pieces (decoders/blocks/) say *what* to compute; a `Lowering` says *how* on the
platform at hand:

- `XlaLowering`: plain HLO (XLA's dot and attention), for any backend: XLA:CPU without
  pyhlo's kernels, GPUs, NeuronCores. The weight layout is the one XLA:CPU streams fastest
  for the element type and batch size (measured: f32 [in, out]; bf16/f16 at batch 1 [out, in]).
- `CpuKernelLowering`: XLA:CPU with pyhlo's kernels (runtime/kernels/): products with few
  activation rows (decode steps at small batch sizes) on the matrix-vector kernel; products of
  more rows (prefill) of GGUF block and int8 weights on GEMM kernels (with int8 activations the
  integer GEMMs, else the exact GEMM that widens a panel of weight rows in cache); decode
  attention reading the cache in place, weights [out, in], decode steps as one unrolled
  program and, as the attention kernel reads only the filled slots, one decode program.

platform_choice.py picks one (the only place that looks at the platform). Tensor
parallelism is a setting of every lowering: each replica's part of a parameter
(decoders/parallel/sharding.py, by its declared `Shard` and the model's `KVSharding`), an
all-reduce after every ROW-sharded product, the LM head's logits left split by vocabulary.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from decoders.blocks.params import Kind, Param, Shard
from decoders.config import QuantizationConfig
from decoders.parallel import sharding
from decoders.parallel.kv_sharding import KVSharding
from decoders.weights.quantize import quantize_per_channel
from decoders.weights.stored import (
    BLOCK_FORMS,
    ROWS,
    BlockWeight,
    QuantizedWeight,
    block_form,
    forms_of,
    ggml_types,
    is_block_form,
    stored_dims,
    stored_dtype,
)
from pyhlo.dtypes import numpy_dtype
from pyhlo.ops import elementwise as ew
from pyhlo.ops import nn
from pyhlo.ops.attention import decode_attention_kernel, prefill_attention_kernel
from pyhlo.ops.collectives import all_reduce_sum
from pyhlo.ops.gguf_blocks import dequantize_gguf, dequantize_gguf_rows
from pyhlo.ops.linalg import (
    BLOCK_KERNEL_FORMS,
    GGUF_GEMM32_X8_KERNEL_TYPES,
    GGUF_GEMM_X8_KERNEL_TYPES,
    GGUF_ROWS32_GEMM_X8_KERNEL_TYPES,
    GGUF_ROWS_X8_KERNEL_TYPES,
    GGUF_X8_KERNEL_TYPES,
    gemm_bf16_kernel,
    gemm_blocks_kernel,
    gemm_blocks_x8_kernel,
    gemm_gguf_rows_x8_kernel,
    gemm_gguf_x8_kernel,
    gemm_s8_kernel,
    gemm_s8_x8_kernel,
    matmul,
    matmul_transposed,
    matvec_blocks_kernel,
    matvec_gguf_kernel,
    matvec_gguf_rows_kernel,
    matvec_kernel,
)
from pyhlo.ops.nn import expand_last
from pyhlo.ops.quantized import dequantize_blocks
from pyhlo.scribe import HloValue, check_precision

# The activation rows (first, last; by weight type, "blocks": GGUF block forms) for which a
# product runs on the matrix-vector kernel, else on XLA's dot: what a CpuKernelLowering made
# without a measurement uses. choose_lowering() takes the rows measured on the machine
# (decoders/kernel_calibration.py).
DEFAULT_KERNEL_ROWS = {"f32": (1, 4), "bf16": (1, 4), "s8": (1, 8), "blocks": (1, 8)}
# With int8 activations, the activation rows from which a K-quant product (of one form or rows
# of mixed K-quants) takes the int8 GEMM instead of the int8 matrix-vector kernel. Measured on
# an AMD EPYC Zen 4 (2 cores, shared; scripts/bench_kquant_gemm.py at SmolLM2-1.7B's MLP
# shapes): about even at 4 rows, the GEMM mostly ahead at 8 (up to 1.8x), 1.3-1.9x at 16 and
# 2.2-3.8x at 128.
K_QUANT_GEMM_FIRST_ROWS = 8


@dataclass(frozen=True)
class XlaLowering:
    """Plain HLO. `dtype` is the amp type of weights, activations and caches."""

    dtype: str
    # "in_out": linear weights [in, out]; "out_in": torch's own [out, in].
    weight_layout: str = "in_out"
    # The LM head's element type: f32 unless the products make the amp type fast.
    head_dtype: str = "f32"
    # Decode steps as one unrolled program (True) or embed, block per layer, head (False).
    whole_model_decode: bool = False
    # Tensor parallelism: every program runs on this many replicas, each holding its part of
    # every sharded parameter (decoders/parallel/sharding.py); ROW products are summed over
    # replicas (all-reduce); the vocabulary-sharded LM head's logits stay split (each
    # replica's rows).
    tp_degree: int = 1
    # How keys and values are shared out over the replicas (decoders/parallel/kv_sharding.py,
    # from NeuronConfig.group_query_attention and shard_over_sequence): which rows of the K and
    # V projections each replica holds, and how the attention piece runs.
    kv_sharding: KVSharding = KVSharding.HEADS
    # Weight quantization (NeuronConfig.quant): the layers' linear weights stored int8 with
    # per-row scales (decoders/config.py: QuantizationConfig); None: every weight in `dtype`.
    quant: QuantizationConfig | None = None
    # Weights a GGUF file stores in a block form, run as stored: (parameter name, form) pairs
    # (decoders/weights/stored.py; chosen by the model from the file, at tp_degree 1).
    gguf_blocks: tuple[tuple[str, str], ...] = ()
    # KV caches of packed int8 rows, a scale per line, head and slot (NeuronConfig.kv_cache_quant).
    kv_cache_quant: bool = False
    # The caches' element type when it differs from `dtype` (NeuronConfig.kv_cache_dtype).
    kv_cache_dtype: str | None = None
    # Kernel products of GGUF block weights whose forms have integer kernels round the activations
    # to int8 (NeuronConfig.int8_activations; has_int8_activation_kernel).
    int8_activations: bool = False
    # How exactly f32 products are computed (NeuronConfig.f32_matmul_precision): "highest" is
    # f32 on every platform; "default" lets a GPU use TF32.
    f32_dot_precision: str = "highest"
    # Generic attention reads the updated caches inside a `conditional`: XLA:CPU then updates
    # them in place instead of copying them whole. Off where a conditional costs more than it
    # saves (a GPU waits for the branch index of each conditional before it goes on).
    attention_in_conditional: bool = True

    name = "xla"

    def __post_init__(self) -> None:
        if self.weight_layout not in ("in_out", "out_in"):
            raise ValueError(f"weight_layout must be 'in_out' or 'out_in', got {self.weight_layout!r}")
        check_precision(self.f32_dot_precision)

    # -- parameters ---------------------------------------------------------------
    def param_dtype(self, param: Param) -> str:
        return stored_dtype(param) or (self.head_dtype if param.is_head else self.dtype)

    def param_dims(self, param: Param) -> tuple[int, ...]:
        """One device's part of the parameter, in the program's layout."""
        if is_block_form(param.quant):
            return stored_dims(param)            # as the file stores them, on one device
        shape = sharding.local_shape(param, self.tp_degree, self.kv_sharding)
        if param.kind is Kind.LINEAR and self.weight_layout == "in_out":
            return tuple(reversed(shape))
        return shape

    @functools.cached_property
    def block_forms(self) -> dict[str, str]:
        """The GGUF block form of each weight that runs in one, by parameter name."""
        return dict(self.gguf_blocks)

    @staticmethod
    def prepare(param: Param, array: np.ndarray | BlockWeight) -> np.ndarray | QuantizedWeight | BlockWeight:
        """What arrange() takes each replica's part of: the checkpoint array (a GGUF block
        weight's blocks), or for an int8 weight and its scales, the weight quantized (once for
        both and every replica)."""
        if param.quant == "s8":
            return QuantizedWeight(*quantize_per_channel(array))
        return array

    def arrange(self, param: Param, array: np.ndarray | QuantizedWeight | BlockWeight,
                rank: int = 0) -> np.ndarray:
        """Replica `rank`'s part of a checkpoint array (or of what prepare() made of it) in the
        program's layout and element type."""
        if is_block_form(param.quant):
            part = array.values
            if param.part_of:
                part = array.mins if param.name.endswith(".min") else array.scales
            return np.ascontiguousarray(part)
        if param.quant == "s8":
            if not isinstance(array, QuantizedWeight):
                array = self.prepare(param, array)
            array = array.scales if param.part_of else array.values
        array = sharding.shard(param, array, self.tp_degree, rank, self.kv_sharding)
        if param.kind is Kind.LINEAR and self.weight_layout == "in_out":
            array = array.T
        return np.ascontiguousarray(array, dtype=numpy_dtype(self.param_dtype(param)))

    @property
    def replica_groups(self) -> list[list[int]]:
        return [list(range(self.tp_degree))]

    # -- products and attention ----------------------------------------------------
    def linear(self, x: HloValue, weight: HloValue, param: Param, bias: HloValue | None = None,
               out_dtype: str | None = None, scale: HloValue | None = None,
               mins: HloValue | None = None) -> HloValue:
        """x @ weight (+ bias). bf16/f16 products accumulate into f32 (XLA:CPU's fast form
        for them, and the accurate one), then return to `out_dtype` or x's type. An int8
        weight is converted to the amp type inside the program and the product multiplied by
        its per-row `scale`; a GGUF block weight is widened with its block `scale` (and
        `mins`) to the amp type, [out, in] whatever the layout."""
        if param.name in self.block_forms:
            form = self.block_forms[param.name]
            widened = widened_blocks(form, weight, scale, mins, self.dtype, param.shape[1])
            accumulate = "f32" if self.dtype != "f32" else None
            product = matmul_transposed(ew.convert(x, self.dtype), widened, out_dtype=out_dtype or accumulate)
            return self._finish(product, param, bias, out_dtype or x.dtype)
        if weight.dtype == "s8":
            weight = ew.convert(weight, self.dtype)
        accumulate = "f32" if weight.dtype != "f32" or scale is not None else None
        product = (matmul if self.weight_layout == "in_out" else matmul_transposed)(
            ew.convert(x, weight.dtype), weight, out_dtype=out_dtype or accumulate)
        if scale is not None:
            product = _scaled(product, scale)
        return self._finish(product, param, bias, out_dtype or x.dtype)

    def _finish(self, product: HloValue, param: Param, bias: HloValue | None, dtype: str) -> HloValue:
        """Sum a ROW product over replicas, add the bias. A VOCAB product (the LM head's logits)
        stays split: the greedy and sampler programs gather candidates, not logits."""
        if self.tp_degree > 1 and param.shard is Shard.ROW:
            product = all_reduce_sum(product, self.replica_groups)
        if bias is not None:
            product = ew.add(product, expand_last(ew.convert(bias, product.dtype), product.dims))
        return ew.convert(product, dtype)

    def decode_attention(self, q: HloValue, cache_k: HloValue, cache_v: HloValue, slot: HloValue,
                         pad: HloValue, scale: float, lines: HloValue | None = None) -> HloValue | None:
        """Attention of one new token per row, each over its cache line (`lines`, None: row i
        line i), when this lowering has a form of its own; None: the piece's generic attention."""
        return None

    def prefill_attention(self, q: HloValue, cache_k: HloValue, cache_v: HloValue, slot: HloValue,
                          pad: HloValue, scale: float, lines: HloValue | None = None,
                          window: int | None = None) -> HloValue | None:
        """Attention of several new tokens per row (a prompt, or a chunk of one), each over its
        cache line, causally from slot[i], when this lowering has a form of its own; None: the
        piece's generic attention."""
        return None

    def decode_buckets(self, token_buckets: list[int], plain_attention: bool) -> list[int]:
        """Cache lengths to build decode programs for."""
        return list(token_buckets)

    def rotary_cos_sin(self, positions: HloValue, inv_freq: np.ndarray,
                       style: str) -> tuple[HloValue, HloValue]:
        """The cos and sin tables of rotary embeddings at these positions (nn.rotary_cos_sin)."""
        return nn.rotary_cos_sin(positions, inv_freq, style)


@dataclass(frozen=True)
class CpuKernelLowering(XlaLowering):
    """XLA:CPU with pyhlo's matrix-vector and decode attention kernels."""

    weight_layout: str = "out_in"
    whole_model_decode: bool = True
    # (weight type, (first, last)): products of first to last activation rows take the kernel.
    kernel_rows: tuple[tuple[str, tuple[int, int]], ...] = tuple(DEFAULT_KERNEL_ROWS.items())
    # With int8_activations: products of Q8_0 / Q4_0 / Q4_1 block weights past the kernel rows
    # (prefill) take the tiled int8 GEMM kernel instead of weights widened to f32 in the
    # program; those of Q5_0 / Q5_1 / IQ4_NL kept as the file's bytes (and rows of mixed such
    # forms) take it instead of the matrix-vector kernel. True where the kernels have a fast
    # form (runtime.cpu_kernels.int8_gemm_is_fast()).
    # The same for int8 weights (`quant`) with k a multiple of 32 (the rounding's blocks).
    int8_gemm: bool = False
    # With int8 activations: K-quant products of K_QUANT_GEMM_FIRST_ROWS or more rows take their
    # int8 GEMM instead of the matrix-vector kernel. True where it has its fast form
    # (runtime.cpu_kernels.k_quant_int8_gemm_is_fast()).
    k_quant_int8_gemm: bool = False
    # Products of GGUF block weights (every form the kernels take, rows of mixed forms too) and
    # of int8 weights (`quant`) past the kernel rows (prefill) without int8 activations in an
    # f32 model take the exact GEMM kernels (each thread widens a panel of weight rows in its
    # cache) instead of weights widened in the program or the matrix-vector kernel. True where
    # they have their fast form (runtime.cpu_kernels.exact_gemm_is_fast()).
    exact_gemm: bool = False
    # Products of bf16 weights past the kernel rows (prefill) take the bf16 GEMM kernel (the
    # same panels, widened from bf16) instead of XLA's dot. True where that is the faster one:
    # its fast form runs and the CPU has no bf16 dot instructions for XLA's
    # (runtime.cpu_kernels.bf16_gemm_is_fast()).
    bf16_gemm: bool = False
    # Attention of several new tokens a row (prompts, chunks of them) takes the prefill
    # attention kernel, which computes only what the causal mask lets each query see (SmolLM2-
    # 135M's heads, a 1,024-token prompt: 84 -> 25 ms a layer on AMD Zen 3). True where its
    # vector form runs (runtime.cpu_kernels.prefill_attention_is_fast()).
    prefill_attention_by_kernel: bool = False

    name = "xla-cpu-kernels"

    def __post_init__(self) -> None:
        if (self.weight_layout != "out_in" or self.dtype not in ("f32", "bf16")
                or self.head_dtype not in ("f32", "bf16")):
            raise ValueError("pyhlo's CPU kernels need weight_layout='out_in' and f32 or bf16 weights, got "
                             f"{self.weight_layout!r} and {self.dtype}/{self.head_dtype}")

    def linear(self, x: HloValue, weight: HloValue, param: Param, bias: HloValue | None = None,
               out_dtype: str | None = None, scale: HloValue | None = None,
               mins: HloValue | None = None) -> HloValue:
        blocks = param.name in self.block_forms
        if blocks and not all(form in BLOCK_KERNEL_FORMS for form in forms_of(self.block_forms[param.name])):
            return super().linear(x, weight, param, bias, out_dtype, scale, mins)  # dequantized in HLO
        first, last = dict(self.kernel_rows).get("blocks" if blocks else weight.dtype, (0, 0))
        rows_in = int(np.prod(x.dims[:-1]))
        as_file = blocks and block_form(self.block_forms[param.name]).as_file
        gemm = self._gemm_product(x, weight, param, scale, mins, rows_in, last)
        if gemm is not None:
            return self._finish(gemm, param, bias, out_dtype or x.dtype)
        # Forms kept as the file's bytes (K-quants, Q5_x, IQ4, rows of mixed forms) take their
        # kernel at every row count a GEMM does not take: the program's own unpacking of them is
        # many operations a value and writes the widened weight out (SmolLM2-1.7B's shape in
        # Q4_K_M, 128-token prompt: 8.8 -> 17.4 tokens/s exact, 8.7 -> 52.9 with int8 activations).
        if 0 < first <= rows_in and (rows_in <= last or as_file):
            # A bf16 model's activations stay bf16 for bf16 weights: an f32 copy would lose the
            # rounding on XLA:CPU (it drops f32 -> bf16 -> f32 converts) and the bf16-pair kernel.
            rows = x if x.dtype == weight.dtype == "bf16" and not blocks else ew.convert(x, "f32")
            quant = self.block_forms[param.name] if blocks else None
            form = block_form(quant) if blocks else None
            rounded = blocks and self.int8_activations and has_int8_activation_kernel(quant)
            if blocks and quant.startswith(ROWS):
                product = matvec_gguf_rows_kernel(rows, weight, ggml_types(quant), rounded)
            elif form is not None and form.as_file:
                product = matvec_gguf_kernel(rows, weight, form.ggml_type, rounded)
            elif blocks:
                product = matvec_blocks_kernel(rows, weight, scale, mins, self.int8_activations)
            else:
                product = matvec_kernel(rows, weight, scale)
            return self._finish(product, param, bias, out_dtype or x.dtype)
        return super().linear(x, weight, param, bias, out_dtype, scale, mins)

    def _gemm_product(self, x: HloValue, weight: HloValue, param: Param, scale: HloValue | None,
                      mins: HloValue | None, rows_in: int, last: int) -> HloValue | None:
        """The product on a GEMM kernel where one takes it (a prefill: more activation rows than the
        matrix-vector kernel's `last`; a K-quant's int8 GEMM from K_QUANT_GEMM_FIRST_ROWS), else None.
        With int8 activations the integer GEMMs; without, in an f32 model, the exact GEMMs that
        widen a panel of weight rows in cache."""
        quant = self.block_forms.get(param.name)
        rounded = self.int8_activations and self.int8_gemm
        exact = self.exact_gemm and self.dtype == "f32" and not self.int8_activations
        if quant is not None:
            form = block_form(quant)
            if (self.int8_activations and self.k_quant_int8_gemm and has_k_quant_gemm(quant)
                    and rows_in >= K_QUANT_GEMM_FIRST_ROWS):
                return gguf_int8_gemm(ew.convert(x, "f32"), weight, quant)
            if rows_in <= last:
                return None
            if not form.as_file and (rounded or exact):
                gemm = gemm_blocks_x8_kernel if rounded else gemm_blocks_kernel
                return gemm(ew.convert(x, "f32"), weight, scale, mins)
            if rounded and has_block32_gemm(quant):
                return gguf_int8_gemm(ew.convert(x, "f32"), weight, quant)
            if form.as_file and exact:
                if quant.startswith(ROWS):
                    return matvec_gguf_rows_kernel(ew.convert(x, "f32"), weight, ggml_types(quant), gemm=True)
                return matvec_gguf_kernel(ew.convert(x, "f32"), weight, form.ggml_type, gemm=True)
            return None
        if weight.dtype == "bf16" and rows_in > last and self.bf16_gemm:
            return gemm_bf16_kernel(ew.convert(x, "f32"), weight)
        if weight.dtype == "s8" and rows_in > last:
            if rounded and weight.dims[1] % 32 == 0:
                return gemm_s8_x8_kernel(ew.convert(x, "f32"), weight, scale)
            if exact:
                return gemm_s8_kernel(ew.convert(x, "f32"), weight, scale)
        return None

    def decode_attention(self, q: HloValue, cache_k: HloValue, cache_v: HloValue, slot: HloValue,
                         pad: HloValue, scale: float, lines: HloValue | None = None) -> HloValue | None:
        return decode_attention_kernel(ew.convert(q, "f32"), cache_k, cache_v, slot, pad, scale, lines)

    def prefill_attention(self, q: HloValue, cache_k: HloValue, cache_v: HloValue, slot: HloValue,
                          pad: HloValue, scale: float, lines: HloValue | None = None,
                          window: int | None = None) -> HloValue | None:
        if not self.prefill_attention_by_kernel:
            return None
        return prefill_attention_kernel(ew.convert(q, "f32"), cache_k, cache_v, slot, pad, scale, lines,
                                        window)

    def decode_buckets(self, token_buckets: list[int], plain_attention: bool) -> list[int]:
        # The kernel reads only the filled slots (within a window, if any), so one program serves
        # every length; attention with a bias or soft-capping (which the kernel does not take)
        # keeps one per bucket.
        return [token_buckets[-1]] if plain_attention else list(token_buckets)

    def rotary_cos_sin(self, positions: HloValue, inv_freq: np.ndarray,
                       style: str) -> tuple[HloValue, HloValue]:
        # Once, by a kernel: XLA:CPU evaluates a program's cos and sin again in each consumer.
        return nn.rotary_cos_sin_kernel(positions, inv_freq, style)


def widened_blocks(form: str, weight: HloValue, scale: HloValue | None, mins: HloValue | None,
                   dtype: str, k: int) -> HloValue:
    """A GGUF block weight [out, k] dequantized in the program, in `dtype`."""
    if form.startswith(ROWS):
        return dequantize_gguf_rows(weight, ggml_types(form), k, dtype)
    if BLOCK_FORMS[form].as_file:
        return dequantize_gguf(weight, BLOCK_FORMS[form].ggml_type, dtype)
    return dequantize_blocks(weight, scale, mins, dtype)


def has_int8_activation_kernel(form: str) -> bool:
    """Whether the kernel of a GGUF block weight's form can round the activations to int8
    (NeuronConfig.int8_activations) as llama.cpp rounds them for the form: Q8_0, Q4_0 and Q4_1
    split into arrays, and every form kept as the file's bytes (GGUF_X8_KERNEL_TYPES), rows of
    mixed forms too (GGUF_ROWS_X8_KERNEL_TYPES)."""
    if not block_form(form).as_file:
        return True
    with_x8 = GGUF_ROWS_X8_KERNEL_TYPES if form.startswith(ROWS) else GGUF_X8_KERNEL_TYPES
    return all(t in with_x8 for t in ggml_types(form))


def has_k_quant_gemm(form: str) -> bool:
    """Whether a GGUF block weight's form has an int8 GEMM over the file's bytes: a K-quant, or
    rows of mixed K-quants (GGUF_GEMM_X8_KERNEL_TYPES)."""
    return block_form(form).as_file and set(ggml_types(form)) <= set(GGUF_GEMM_X8_KERNEL_TYPES)


def has_block32_gemm(form: str) -> bool:
    """Whether a GGUF block weight kept as the file's bytes is of forms of 32-value blocks with an
    int8 GEMM (the block forms' tiled GEMM): Q5_0, Q5_1 or IQ4_NL, or rows of mixed such forms
    and Q8_0 / Q4_0 / Q4_1."""
    types = set(ggml_types(form))
    if not block_form(form).as_file:
        return False
    if form.startswith(ROWS):
        return types <= set(GGUF_ROWS32_GEMM_X8_KERNEL_TYPES)
    return types <= set(GGUF_GEMM32_X8_KERNEL_TYPES)


def gguf_int8_gemm(x: HloValue, weight: HloValue, form: str) -> HloValue:
    """x @ weight.T on the int8 GEMM of a form has_k_quant_gemm() or has_block32_gemm() accepts."""
    if form.startswith(ROWS):
        return gemm_gguf_rows_x8_kernel(x, weight, ggml_types(form))
    return gemm_gguf_x8_kernel(x, weight, BLOCK_FORMS[form].ggml_type)


def _scaled(product: HloValue, scale: HloValue) -> HloValue:
    """product [..., out] times the per-row scales [out] of the weight that made it."""
    return ew.multiply(product, expand_last(ew.convert(scale, product.dtype), product.dims))
