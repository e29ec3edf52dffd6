"""Which lowering runs a model on this backend: the one place that looks at the platform.

XLA:CPU with pyhlo's kernels where they can run (products on the matrix-vector kernel up to
the activation rows timed on this CPU: kernel_calibration.py), XLA:GPU's shape of plain HLO
on CUDA, plain HLO elsewhere. Every lowering takes the model's settings alike, each by name:
tensor parallelism (tp_degree, kv_sharding), weight and KV-cache quantization, GGUF block
weights and the f32 dot precision.
"""
from __future__ import annotations

import logging
from typing import Any

from decoders.config import NeuronConfig
from decoders.kernel_calibration import kernel_rows
from decoders.lowering import CpuKernelLowering, XlaLowering, has_int8_activation_kernel
from decoders.parallel.kv_sharding import KVSharding

progress = logging.getLogger("pyhlo.progress")

# Told once a process, at the first model whose block weights could take int8 activations.
EXACT_BLOCKS_HINT = (
    "GGUF block weights run in exact arithmetic (each block widened to f32, the file's function as "
    "HF transformers computes it). int8 activations (NeuronConfig(int8_activations=True); "
    "--int8-activations on the command line) take llama.cpp's arithmetic and pyhlo's integer kernels: "
    "measured on an AVX2 CPU (AMD Zen 3) they decoded 1.7 B Q4_0 and Q4_K_M files about 2x faster (the "
    "README's performance section).")
_hinted = False


def preferred_weight_layout(dtype: str, batch_size: int) -> str:
    """The weight layout whose matrix-vector products stream fastest on XLA:CPU's own dot:
    f32 [in, out] at every batch size; bf16 and f16 at batch 1 only [out, in]."""
    return "out_in" if dtype in ("bf16", "f16") and batch_size == 1 else "in_out"


def _cpu_kernel_obstacles(neuron_config: NeuronConfig, backend: Any, dtype: str) -> list[str]:
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
            reasons.append("the kernels are off (PYHLO_CPU_KERNELS=0, or they did not build: see the "
                           "warning)")
    return reasons


def choose_lowering(neuron_config: NeuronConfig, backend: Any, dtype: str, batch_size: int,
                    tp_degree: int = 1, kv_sharding: KVSharding = KVSharding.HEADS,
                    gguf_blocks: tuple[tuple[str, str], ...] = ()) -> XlaLowering:
    """The lowering for this backend and configuration.

    NeuronConfig.cpu_kernels None (the default) uses pyhlo's CPU kernels where they can run:
    XLA:CPU, f32 or bf16 weights, [out, in] layout, a C++ compiler to build them, and
    PYHLO_CPU_KERNELS not 0. True insists (an error says what is missing); False is off.
    NeuronConfig.whole_model_program None unrolls decode steps where that is faster (with
    the kernels: it saves the launch of one block program per layer, about 37 us each).
    """
    wanted = neuron_config.cpu_kernels
    rounding = [form for _, form in gguf_blocks if has_int8_activation_kernel(form)]
    if neuron_config.int8_activations and not rounding and neuron_config.quant is None:
        raise ValueError("NeuronConfig.int8_activations applies to GGUF weights kept in their blocks (Q8_0, "
                         "Q4_0, Q4_1, Q5_0, Q5_1, the K-quants Q2_K to Q6_K, IQ4_NL, IQ4_XS) or to int8 "
                         "weights (NeuronConfig(quant=QuantizationConfig())), and this model has neither (a "
                         ".gguf file with such tensors, tp_degree 1)")
    if wanted is not False:
        reasons = _cpu_kernel_obstacles(neuron_config, backend, dtype)
        if reasons and wanted:
            raise ValueError("NeuronConfig.cpu_kernels=True, but " + "; ".join(reasons))
        if not reasons:
            if rounding and not neuron_config.int8_activations:
                _hint_int8_activations()
            return cpu_kernel_lowering(neuron_config, backend, dtype, tp_degree=tp_degree,
                                       kv_sharding=kv_sharding, gguf_blocks=gguf_blocks)
    if neuron_config.int8_activations:
        obstacles = "; ".join(_cpu_kernel_obstacles(neuron_config, backend, dtype)) or "cpu_kernels=False"
        raise ValueError("NeuronConfig.int8_activations rounds activations inside pyhlo's CPU kernels, which "
                         "this model does not use: " + obstacles)
    if getattr(backend, "platform", None) == "cuda":
        return gpu_lowering(neuron_config, dtype, tp_degree=tp_degree, kv_sharding=kv_sharding,
                            gguf_blocks=gguf_blocks)
    return xla_lowering(neuron_config, dtype, batch_size, tp_degree=tp_degree, kv_sharding=kv_sharding,
                        gguf_blocks=gguf_blocks)


def _hint_int8_activations() -> None:
    global _hinted
    if not _hinted:
        _hinted = True
        progress.info(EXACT_BLOCKS_HINT)


def cpu_kernel_lowering(neuron_config: NeuronConfig, backend: Any, dtype: str, tp_degree: int = 1,
                        kv_sharding: KVSharding = KVSharding.HEADS,
                        gguf_blocks: tuple[tuple[str, str], ...] = ()) -> CpuKernelLowering:
    """XLA:CPU with pyhlo's kernels: products of the activation rows the kernel wins on this
    CPU (measured once: kernel_calibration.kernel_rows) on the matrix-vector kernel, the LM
    head in the amp type, decode steps as one program unless NeuronConfig says otherwise."""
    from runtime import cpu_kernels

    whole = neuron_config.whole_model_program
    return CpuKernelLowering(dtype, head_dtype=dtype, whole_model_decode=True if whole is None else whole,
                             kernel_rows=tuple(kernel_rows(backend).items()),
                             int8_activations=neuron_config.int8_activations,
                             int8_gemm=neuron_config.int8_activations and cpu_kernels.int8_gemm_is_fast(),
                             k_quant_int8_gemm=(neuron_config.int8_activations
                                                and cpu_kernels.k_quant_int8_gemm_is_fast()),
                             exact_gemm=cpu_kernels.exact_gemm_is_fast(),
                             bf16_gemm=cpu_kernels.bf16_gemm_is_fast(),
                             prefill_attention_by_kernel=cpu_kernels.prefill_attention_is_fast(),
                             tp_degree=tp_degree, kv_sharding=kv_sharding, quant=neuron_config.quant,
                             gguf_blocks=gguf_blocks, kv_cache_quant=neuron_config.kv_cache_quant,
                             kv_cache_dtype=neuron_config.kv_cache_dtype,
                             f32_dot_precision=neuron_config.f32_dot_precision)


def gpu_lowering(neuron_config: NeuronConfig, dtype: str, tp_degree: int = 1,
                 kv_sharding: KVSharding = KVSharding.HEADS,
                 gguf_blocks: tuple[tuple[str, str], ...] = ()) -> XlaLowering:
    """Plain HLO shaped for XLA:GPU: weights in the checkpoint's own [out, in] layout (cuBLAS
    reads either; nothing is transposed on the host), the LM head in the amp type with f32
    accumulation (as the other products), a decode step as one program (one launch per token
    instead of one per layer), and attention without a `conditional` (whose branch index the
    GPU runtime must read back before it launches what follows)."""
    whole = neuron_config.whole_model_program
    return XlaLowering(dtype, neuron_config.weight_layout or "out_in", head_dtype=dtype,
                       whole_model_decode=True if whole is None else whole, attention_in_conditional=False,
                       tp_degree=tp_degree, kv_sharding=kv_sharding, quant=neuron_config.quant,
                       gguf_blocks=gguf_blocks, kv_cache_quant=neuron_config.kv_cache_quant,
                       kv_cache_dtype=neuron_config.kv_cache_dtype,
                       f32_dot_precision=neuron_config.f32_dot_precision)


def xla_lowering(neuron_config: NeuronConfig, dtype: str, batch_size: int, tp_degree: int = 1,
                 kv_sharding: KVSharding = KVSharding.HEADS,
                 gguf_blocks: tuple[tuple[str, str], ...] = ()) -> XlaLowering:
    """Plain HLO for any backend: weights in the layout XLA:CPU's dot streams fastest
    (preferred_weight_layout) unless NeuronConfig names one, the LM head in f32, decode steps
    per block unless NeuronConfig.whole_model_program asks for one program."""
    layout = neuron_config.weight_layout or preferred_weight_layout(dtype, batch_size)
    whole = bool(neuron_config.whole_model_program)
    return XlaLowering(dtype, layout, head_dtype="f32", whole_model_decode=whole,
                       tp_degree=tp_degree, kv_sharding=kv_sharding, quant=neuron_config.quant,
                       gguf_blocks=gguf_blocks, kv_cache_quant=neuron_config.kv_cache_quant,
                       kv_cache_dtype=neuron_config.kv_cache_dtype,
                       f32_dot_precision=neuron_config.f32_dot_precision)
