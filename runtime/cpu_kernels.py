"""Hand-written CPU kernels that XLA calls as typed-FFI custom calls.

    from runtime import cpu_kernels
    if cpu_kernels.register():          # builds once, then registers with XLA:CPU
        ...emit custom-calls "pyhlo_matvec", "pyhlo_matvec_s8", "pyhlo_matvec_q8_0" (_q4_0, _q4_1),
        "pyhlo_matvec_q4_k" (_q5_k, _q6_k, _q5_0 ...: GGUF blocks as the file stores them;
        "pyhlo_matvec_q4_k_x8" ...: the K-quants with int8 activations),
        "pyhlo_gemm_q8_0" (_q4_0, _q4_1, "pyhlo_gemm_s8", "pyhlo_gemm_bf16": prefill products of
        weights widened in a cache-sized panel),
        "pyhlo_gemm_q8_0_x8" (_q4_0_x8, _q4_1_x8: prefill products with int8 activations;
        "pyhlo_gemm_s8_x8": the same for int8 weights with a scale per row),
        "pyhlo_gemm_q4_k_x8" (_q2_k_x8 ... _q6_k_x8, _gguf_rows_x8: the same for K-quants as the file
        stores them),
        "pyhlo_decode_attention", "pyhlo_prefill_attention", "pyhlo_rotary_cos_sin" in CPU programs...

The sources live in runtime/kernels/. They are compiled with the machine's C++ compiler
(`CXX`, else g++, else c++) against the XLA FFI headers that ship with jaxlib, for this
CPU (-march=native), into a cache directory (env PYHLO_KERNEL_DIR, default
~/.cache/pyhlo/kernels) under a name that hashes the source, the compiler flags, the
jaxlib version and the CPU, and reused from there. PYHLO_CPU_KERNELS=0 turns them off;
without a compiler they are off, with one warning, and programs use XLA's own dot.
PYHLO_KERNEL_FLAGS adds compiler flags (e.g. "-mno-avx512f" builds the AVX2 forms on an
AVX-512 machine, as the tests do to check every form the host can run).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile
import warnings

MATVEC_TARGET = "pyhlo_matvec"
MATVEC_S8_TARGET = "pyhlo_matvec_s8"
DECODE_ATTENTION_TARGET = "pyhlo_decode_attention"
# Several new tokens a line (a prompt or a chunk of one) over its cache, causally.
PREFILL_ATTENTION_TARGET = "pyhlo_prefill_attention"
ROTARY_COS_SIN_TARGET = "pyhlo_rotary_cos_sin"
# GGUF block forms: "q8_0", "q4_0", "q4_1" -> the kernel's target
MATVEC_BLOCK_TARGETS = {form: f"pyhlo_matvec_{form}" for form in ("q8_0", "q4_0", "q4_1")}
# The same with the activations rounded to int8 per 32 values (NeuronConfig(int8_activations=True)).
MATVEC_BLOCK_X8_TARGETS = {form: f"pyhlo_matvec_{form}_x8" for form in ("q8_0", "q4_0", "q4_1")}
# Prefill products of the same forms, exact: each thread widens a panel of weight rows to f32 in
# its cache (runtime/kernels/gemm_blocks.cc, widened_panels.h).
GEMM_BLOCK_TARGETS = {form: f"pyhlo_gemm_{form}" for form in ("q8_0", "q4_0", "q4_1")}
# The same for int8 weights with one f32 scale per row.
GEMM_S8_TARGET = "pyhlo_gemm_s8"
# The same for bf16 weights (runtime/kernels/gemm_bf16.cc).
GEMM_BF16_TARGET = "pyhlo_gemm_bf16"
# Prefill products of the same forms, x rounded to int8 as the _x8 targets do: a tiled integer GEMM.
GEMM_BLOCK_X8_TARGETS = {form: f"pyhlo_gemm_{form}_x8" for form in ("q8_0", "q4_0", "q4_1")}
# The same for int8 weights with one f32 scale per row (pyhlo_matvec_s8's operands).
GEMM_S8_X8_TARGET = "pyhlo_gemm_s8_x8"
# Prefill products of the K-quants kept as the file's bytes, x rounded as their _x8 matvec
# targets round it (llama.cpp's Q8_K): a tiled integer GEMM (runtime/kernels/gemm_kquants.cc).
GEMM_GGUF_X8_TARGETS = {ggml_type: f"pyhlo_gemm_{ggml_type.lower()}_x8"
                        for ggml_type in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")}
# The same for a weight whose rows come in several K-quant forms, each row's form in its last byte.
GEMM_GGUF_ROWS_X8_TARGET = "pyhlo_gemm_gguf_rows_x8"
# Prefill products of the forms of 32-value blocks kept as the file's bytes, x rounded per 32 as
# their _x8 matvec targets round it (llama.cpp's Q8_1): the tiled integer GEMM of the block forms
# (runtime/kernels/gemm_blocks.cc); and of rows of mixed such forms (Q8_0, Q4_0, Q4_1 too).
GEMM_GGUF32_X8_TARGETS = {ggml_type: f"pyhlo_gemm_{ggml_type.lower()}_x8"
                          for ggml_type in ("Q5_0", "Q5_1", "IQ4_NL")}
GEMM_GGUF_ROWS32_X8_TARGET = "pyhlo_gemm_gguf_rows32_x8"
# GGUF blocks kept as the file's bytes (decoders/weights/stored.py): GGML type -> target
MATVEC_GGUF_TARGETS = {ggml_type: f"pyhlo_matvec_{ggml_type.lower()}"
                       for ggml_type in ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                                         "IQ4_NL", "IQ4_XS")}
# The same with the activations rounded to int8 as llama.cpp rounds them for each form
# (NeuronConfig(int8_activations=True)): per 256 values (Q8_K) for the K-quants and IQ4_XS, per
# 32 (Q8_0 / Q8_1) for Q5_0, Q5_1 and IQ4_NL.
MATVEC_GGUF_X8_TARGETS = {ggml_type: f"pyhlo_matvec_{ggml_type.lower()}_x8"
                          for ggml_type in ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                                            "IQ4_NL", "IQ4_XS")}
# Prefill products of the forms kept as the file's bytes (and of mixed rows), exact: each thread
# widens a panel of weight rows to f32 in its cache (runtime/kernels/widened_panels.h).
GEMM_GGUF_TARGETS = {ggml_type: f"pyhlo_gemm_{ggml_type.lower()}" for ggml_type in MATVEC_GGUF_TARGETS}
GEMM_GGUF_ROWS_TARGET = "pyhlo_gemm_gguf_rows"
# A weight whose rows come in several GGUF forms, each row's form in its last byte (_x8: the
# activations rounded each way its rows' forms take them).
MATVEC_GGUF_ROWS_TARGET = "pyhlo_matvec_gguf_rows"
MATVEC_GGUF_ROWS_X8_TARGET = "pyhlo_matvec_gguf_rows_x8"
# custom-call target -> the handler symbol the library exports
TARGETS = {MATVEC_TARGET: "PyhloMatvec", MATVEC_S8_TARGET: "PyhloMatvecS8",
           DECODE_ATTENTION_TARGET: "PyhloDecodeAttention",
           PREFILL_ATTENTION_TARGET: "PyhloPrefillAttention", ROTARY_COS_SIN_TARGET: "PyhloRotaryCosSin",
           **{target: f"PyhloMatvec{form.capitalize()}" for form, target in MATVEC_BLOCK_TARGETS.items()},
           **{target: f"PyhloMatvec{form.capitalize()}X8"
              for form, target in MATVEC_BLOCK_X8_TARGETS.items()},
           **{target: f"PyhloGemm{form.capitalize()}" for form, target in GEMM_BLOCK_TARGETS.items()},
           **{target: f"PyhloGemm{form.capitalize()}X8" for form, target in GEMM_BLOCK_X8_TARGETS.items()},
           **{target: f"PyhloGemm{ggml_type}X8" for ggml_type, target in GEMM_GGUF_X8_TARGETS.items()},
           **{target: f"PyhloGemm{ggml_type}X8" for ggml_type, target in GEMM_GGUF32_X8_TARGETS.items()},
           GEMM_GGUF_ROWS32_X8_TARGET: "PyhloGemmGgufRows32X8",
           **{target: f"PyhloMatvec{ggml_type}" for ggml_type, target in MATVEC_GGUF_TARGETS.items()},
           **{target: f"PyhloMatvec{ggml_type}X8" for ggml_type, target in MATVEC_GGUF_X8_TARGETS.items()},
           GEMM_GGUF_ROWS_X8_TARGET: "PyhloGemmGgufRowsX8", GEMM_S8_X8_TARGET: "PyhloGemmS8X8",
           GEMM_S8_TARGET: "PyhloGemmS8", GEMM_BF16_TARGET: "PyhloGemmBf16",
           **{target: f"PyhloGemm{ggml_type}" for ggml_type, target in GEMM_GGUF_TARGETS.items()},
           GEMM_GGUF_ROWS_TARGET: "PyhloGemmGgufRows",
           MATVEC_GGUF_ROWS_TARGET: "PyhloMatvecGgufRows",
           MATVEC_GGUF_ROWS_X8_TARGET: "PyhloMatvecGgufRowsX8"}
_SOURCES = [pathlib.Path(__file__).with_name("kernels") / name
            for name in ("matvec.cc", "matvec_gguf.cc", "gemm_blocks.cc", "gemm_kquants.cc",
                         "gemm_bf16.cc", "decode_attention.cc", "prefill_attention.cc", "rotary.cc")]
# Included by the sources: part of what the library's cache name hashes.
_HEADERS = [pathlib.Path(__file__).with_name("kernels") / name
            for name in ("half.h", "vector_sum.h", "byte_lanes.h", "kquants.h", "q8_blocks.h",
                         "block32_forms.h", "block_operands.h", "attention_operands.h", "gemm_panels.h",
                         "row_chunks.h", "mixed_rows.h", "widened_panels.h")]
_BASE_FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC"]


def _flags() -> list[str]:
    return _BASE_FLAGS + os.environ.get("PYHLO_KERNEL_FLAGS", "").split()


class KernelBuildError(RuntimeError):
    pass


def enabled() -> bool:
    """False when PYHLO_CPU_KERNELS says off (0, false, no, off)."""
    return os.environ.get("PYHLO_CPU_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def kernel_dir() -> pathlib.Path:
    default = pathlib.Path.home() / ".cache" / "pyhlo" / "kernels"
    return pathlib.Path(os.environ.get("PYHLO_KERNEL_DIR") or default)


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def build(compiler: str | None = None) -> pathlib.Path:
    """The kernel library for this machine, compiled now unless already in the cache."""
    import jax.ffi
    import jaxlib

    compiler = compiler or _compiler()
    if compiler is None:
        raise KernelBuildError("no C++ compiler found (set CXX, or install g++)")
    sources = b"\0".join(path.read_bytes() for path in _SOURCES + _HEADERS)
    digest = hashlib.sha256(b"\0".join([
        sources, " ".join(_flags()).encode(), compiler.encode(), jaxlib.__version__.encode(),
        _cpu_flags().encode(),
    ])).hexdigest()[:16]
    target = kernel_dir() / f"libpyhlo_kernels-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    import logging

    logging.getLogger("pyhlo.progress").info("building pyhlo's CPU kernels with %s (once, a few seconds) ...",
                                             pathlib.Path(compiler).name)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = pathlib.Path(tmp) / target.name
        command = [compiler, *_flags(), f"-I{jax.ffi.include_dir()}", *map(str, _SOURCES), "-o", str(built)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise KernelBuildError(f"{' '.join(command)} failed:\n{result.stderr.strip()}")
        os.replace(built, target)   # atomic: concurrent builders each write a whole file
    return target


_loaded: list[ctypes.CDLL] = []   # kept for the life of the process


@functools.lru_cache(maxsize=1)
def _registered() -> bool:
    import jax.ffi

    try:
        library = ctypes.CDLL(str(build()))
        _loaded.append(library)
    except (KernelBuildError, OSError) as error:
        warnings.warn(f"pyhlo CPU kernels are off, programs use XLA's own dot: {error}", stacklevel=3)
        return False
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    return True


def register() -> bool:
    """Build (once) and register the kernels with XLA:CPU; False when they are off."""
    return enabled() and _registered()


def int8_gemm_is_fast() -> bool:
    """Whether the int8 GEMM kernels of the block forms and int8 rows (GEMM_BLOCK_X8_TARGETS,
    GEMM_S8_X8_TARGET, GEMM_GGUF32_X8_TARGETS, GEMM_GGUF_ROWS32_X8_TARGET) run in a vector form
    on this machine: AVX-512 VNNI, or AVX2's vpmaddubsw. Elsewhere they have a portable form,
    correct but slower than XLA's dot, which the lowering does not take."""
    return register() and bool(_loaded[-1].PyhloGemmBlocksFast())


def k_quant_int8_gemm_is_fast() -> bool:
    """Whether the K-quants' int8 GEMM kernels (GEMM_GGUF_X8_TARGETS) run in a vector form on
    this machine: AVX-512 VNNI, or AVX2's vpmaddubsw. Elsewhere they have a portable form, slower
    than the matrix-vector kernel, which the lowering takes instead."""
    return register() and bool(_loaded[-1].PyhloGemmKQuantsFast())


def exact_gemm_is_fast() -> bool:
    """Whether the exact GEMM kernels (GEMM_BLOCK_TARGETS, GEMM_S8_TARGET, GEMM_GGUF_TARGETS,
    GEMM_GGUF_ROWS_TARGET) run in a vector form (AVX-512, or AVX2 with FMA) on this machine.
    Elsewhere they have a portable form, correct but slower than XLA's dot, which the lowering
    does not take."""
    return register() and bool(_loaded[-1].PyhloGemmExactFast())


def bf16_gemm_is_fast() -> bool:
    """Whether the bf16 GEMM kernel (GEMM_BF16_TARGET) is the faster way to a bf16 prefill
    product on this machine: its vector form (AVX-512, or AVX2 with FMA) runs, and the CPU has
    no bf16 dot instructions (AVX512_BF16) that XLA's own dot takes."""
    return register() and bool(_loaded[-1].PyhloGemmBf16Fast())


def prefill_attention_is_fast() -> bool:
    """Whether the prefill attention kernel (PREFILL_ATTENTION_TARGET) runs its vector tiles on
    this machine (AVX2 with FMA). Elsewhere it has a portable form, correct but not faster than
    the program's own attention, which the lowering keeps."""
    return register() and bool(_loaded[-1].PyhloPrefillAttentionFast())


def referenced_by(data: bytes) -> bool:
    """Whether HLO or executable bytes call one of these kernels."""
    return any(target.encode() in data for target in TARGETS)
