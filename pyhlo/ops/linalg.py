"""Matrix products."""
from __future__ import annotations

from typing import Sequence

from pyhlo.ops.custom_call import ffi_call
from pyhlo.scribe import HloValue, check_precision
from pyhlo.shape_inference import HloShapeError


def dot_general(lhs: HloValue, rhs: HloValue, contracting: tuple[Sequence[int], Sequence[int]],
                batch: tuple[Sequence[int], Sequence[int]] = ((), ()),
                out_dtype: str | None = None, precision: str | None = None) -> HloValue:
    """XLA dot: output dims are batch dims, then lhs free dims, then rhs free dims.

    `out_dtype` lets bf16 or f16 operands accumulate into an f32 result. `precision`
    ("highest", "high", "default"): how exactly the compiler must multiply; None: for f32
    operands the scribe's f32_dot_precision ("highest" unless the module says otherwise, so
    that a GPU does not round f32 products to TF32), for others the compiler's default.
    """
    (lc, rc), (lb, rb) = contracting, batch
    lhs_free = [d for i, d in enumerate(lhs.dims) if i not in lc and i not in lb]
    rhs_free = [d for i, d in enumerate(rhs.dims) if i not in rc and i not in rb]
    dims = [lhs.dims[i] for i in lb] + lhs_free + rhs_free
    numbers = dict(lhs_contracting_dimensions=list(lc), rhs_contracting_dimensions=list(rc),
                   lhs_batch_dimensions=list(lb), rhs_batch_dimensions=list(rb))
    shape = getattr(lhs.scribe, out_dtype or lhs.dtype)[tuple(dims)]
    if precision is None:  # the scribe gives f32 dots its f32_dot_precision
        return shape.Dot(lhs, rhs, dot_dimension_numbers=numbers)
    config = {"operand_precision": [check_precision(precision).upper()] * 2}
    return shape.Dot(lhs, rhs, dot_dimension_numbers=numbers, precision_config=config)


def matmul(x: HloValue, w: HloValue, out_dtype: str | None = None) -> HloValue:
    """x[..., k] @ w[k, n] -> [..., n]."""
    return dot_general(x, w, ([len(x.dims) - 1], [0]), out_dtype=out_dtype)


def matmul_transposed(x: HloValue, w: HloValue, out_dtype: str | None = None) -> HloValue:
    """x[..., k] @ w[n, k].T -> [..., n] (weights stored as [out, in], like torch Linear)."""
    return dot_general(x, w, ([len(x.dims) - 1], [1]), out_dtype=out_dtype)


def matvec_kernel(x: HloValue, w: HloValue, scale: HloValue | None = None,
                  target: str | None = None) -> HloValue:
    """x[..., k] (f32) @ w[n, k].T -> f32[..., n] by a CPU kernel called through XLA's typed FFI.

    `w` is f32 or bf16 in torch's [out, in] layout, or s8 with `scale` f32[n], one per weight
    row (per output channel): the product is then scale * (x @ w.T). With bf16 weights x may
    be bf16 too (a bf16 model's activations, multiplied in bf16 pairs where the CPU can). The
    kernel must be registered with the backend (runtime.cpu_kernels.register()) before a
    program using it is compiled.
    """
    quantized = w.dtype == "s8"
    if (x.dtype not in ("f32", "bf16") or (x.dtype == "bf16" and w.dtype != "bf16")
            or w.dtype not in ("f32", "bf16", "s8") or len(w.dims) != 2
            or x.dims[-1] != w.dims[1]
            or quantized != (scale is not None)
            or (quantized and (scale.dtype != "f32" or scale.dims != (w.dims[0],)))):
        raise HloShapeError(f"matvec_kernel: need f32 x[..., k] and f32/bf16 w[n, k] (or bf16 x and bf16 w), "
                            f"or s8 w[n, k] with f32 scale[n]; got {x.dtype}{list(x.dims)}, "
                            f"{w.dtype}{list(w.dims)}"
                            + (f" and scale {scale.dtype}{list(scale.dims)}" if scale is not None else ""))
    shape = x.scribe.f32[(*x.dims[:-1], w.dims[0])]
    if quantized:
        return ffi_call(shape, [x, w, scale], target or "pyhlo_matvec_s8")
    return ffi_call(shape, [x, w], target or "pyhlo_matvec")


# The GGUF block forms the kernels multiply by: split into arrays (matvec_blocks_kernel), or
# as the file's bytes (matvec_gguf_kernel, by GGML type).
BLOCK_KERNEL_FORMS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k",
                      "iq4_nl", "iq4_xs")


def matvec_blocks_kernel(x: HloValue, values: HloValue, scales: HloValue, mins: HloValue | None = None,
                         int8_activations: bool = False) -> HloValue:
    """x[..., k] (f32) @ w.T -> f32[..., n] by a CPU kernel, w[n, k] kept in one of llama.cpp's
    GGUF block forms (pyhlo.ops.quantized has the layout): s8 values [n, k] with f16 scales
    [n, k/32] are Q8_0; u8 values [n, k/2] with f16 scales are Q4_0, and with f16 `mins` too,
    Q4_1. Each block is widened to f32 in registers; with int8_activations, x is rounded per 32
    values to int8 (d = max|x| / 127, as llama.cpp rounds activations) and each block's product
    is an integer sum (the _x8 targets). The kernel must be registered with the backend
    (runtime.cpu_kernels.register()) before a program using it is compiled."""
    form = _block_form("matvec_blocks_kernel", x, values, scales, mins)
    operands = [x, values, scales] + ([mins] if mins is not None else [])
    target = f"pyhlo_matvec_{form}" + ("_x8" if int8_activations else "")
    return ffi_call(x.scribe.f32[(*x.dims[:-1], values.dims[0])], operands, target)


def gemm_blocks_kernel(x: HloValue, values: HloValue, scales: HloValue,
                       mins: HloValue | None = None) -> HloValue:
    """matvec_blocks_kernel(...) for many activation rows (a prefill): the same operands and the
    same exact product (the weights widened to f32 as the program widens them, x f32), each
    thread widening a panel of weight rows in its cache once for all activation rows
    (runtime/kernels/gemm_blocks.cc). The kernel must be registered with the backend
    (runtime.cpu_kernels.register()) before a program using it is compiled."""
    form = _block_form("gemm_blocks_kernel", x, values, scales, mins)
    operands = [x, values, scales] + ([mins] if mins is not None else [])
    return ffi_call(x.scribe.f32[(*x.dims[:-1], values.dims[0])], operands, f"pyhlo_gemm_{form}")


def gemm_s8_kernel(x: HloValue, w: HloValue, scale: HloValue) -> HloValue:
    """x[..., k] (f32) @ (w[n, k] * scale[:, None]).T -> f32[..., n] for many activation rows (a
    prefill) of int8 weights with one f32 scale per row (matvec_kernel's s8 operands), exact: each
    thread widens a panel of weight rows to f32 in its cache once for all activation rows
    (runtime/kernels/gemm_blocks.cc). The kernel must be registered with the backend
    (runtime.cpu_kernels.register()) before a program using it is compiled."""
    if (x.dtype != "f32" or w.dtype != "s8" or len(w.dims) != 2 or x.dims[-1] != w.dims[1]
            or scale.dtype != "f32" or scale.dims != (w.dims[0],)):
        raise HloShapeError(f"gemm_s8_kernel: need f32 x[..., k], s8 w[n, k] and f32 scale[n]; got "
                            f"{x.dtype}{list(x.dims)}, {w.dtype}{list(w.dims)} and scale "
                            f"{scale.dtype}{list(scale.dims)}")
    return ffi_call(x.scribe.f32[(*x.dims[:-1], w.dims[0])], [x, w, scale], "pyhlo_gemm_s8")


def gemm_bf16_kernel(x: HloValue, w: HloValue) -> HloValue:
    """x[..., k] (f32) @ w[n, k].T -> f32[..., n] for many activation rows (a prefill) of bf16
    weights, exact: each weight widened to f32 as convert() widens it, each thread widening a
    panel of weight rows in its cache once for all activation rows (runtime/kernels/gemm_bf16.cc).
    The kernel must be registered with the backend (runtime.cpu_kernels.register()) before a
    program using it is compiled."""
    if x.dtype != "f32" or w.dtype != "bf16" or len(w.dims) != 2 or x.dims[-1] != w.dims[1]:
        raise HloShapeError(f"gemm_bf16_kernel: need f32 x[..., k] and bf16 w[n, k]; got "
                            f"{x.dtype}{list(x.dims)} and {w.dtype}{list(w.dims)}")
    return ffi_call(x.scribe.f32[(*x.dims[:-1], w.dims[0])], [x, w], "pyhlo_gemm_bf16")


def gemm_s8_x8_kernel(x: HloValue, w: HloValue, scale: HloValue) -> HloValue:
    """x[..., k] (f32) @ w[n, k].T * scale -> f32[..., n] for many activation rows (a prefill) of
    int8 weights with one f32 scale per row (matvec_kernel's s8 operands): x rounded to int8 per
    32 values as the _x8 targets round it (d = max|x| / 127), each block's product an integer
    sum, on the tiled integer GEMM (runtime/kernels/gemm_blocks.cc). k must be a multiple of 32.
    The kernel must be registered with the backend (runtime.cpu_kernels.register()) before a
    program using it is compiled."""
    if (x.dtype != "f32" or w.dtype != "s8" or len(w.dims) != 2 or x.dims[-1] != w.dims[1]
            or w.dims[1] % 32 or scale.dtype != "f32" or scale.dims != (w.dims[0],)):
        raise HloShapeError(f"gemm_s8_x8_kernel: need f32 x[..., k] (k a multiple of 32), s8 w[n, k] and f32 "
                            f"scale[n]; got {x.dtype}{list(x.dims)}, {w.dtype}{list(w.dims)} and scale "
                            f"{scale.dtype}{list(scale.dims)}")
    return ffi_call(x.scribe.f32[(*x.dims[:-1], w.dims[0])], [x, w, scale], "pyhlo_gemm_s8_x8")


def gemm_blocks_x8_kernel(x: HloValue, values: HloValue, scales: HloValue,
                          mins: HloValue | None = None) -> HloValue:
    """matvec_blocks_kernel(..., int8_activations=True) for many activation rows (a prefill): the
    same operands, the same rounding of x to int8 per 32 values, the products as a tiled integer
    GEMM (runtime/kernels/gemm_blocks.cc). The kernel must be registered with the backend
    (runtime.cpu_kernels.register()) before a program using it is compiled."""
    form = _block_form("gemm_blocks_x8_kernel", x, values, scales, mins)
    operands = [x, values, scales] + ([mins] if mins is not None else [])
    return ffi_call(x.scribe.f32[(*x.dims[:-1], values.dims[0])], operands, f"pyhlo_gemm_{form}_x8")


def _block_form(op: str, x: HloValue, values: HloValue, scales: HloValue, mins: HloValue | None) -> str:
    """The block form ("q8_0", "q4_0", "q4_1") of a block kernel's operands, which it checks."""
    per_byte = 1 if values.dtype == "s8" else 2
    k = x.dims[-1] if x.dims else -1
    if (x.dtype != "f32" or values.dtype not in ("s8", "u8") or len(values.dims) != 2 or k % 32
            or values.dims[1] * per_byte != k or scales.dtype != "f16"
            or scales.dims != (values.dims[0], k // 32)
            or (mins is not None
                and (values.dtype != "u8" or mins.dtype != "f16" or mins.dims != scales.dims))):
        got = [f"{v.dtype}{list(v.dims)}" for v in (x, values, scales, mins) if v is not None]
        raise HloShapeError(f"{op}: need f32 x[..., k] (k a multiple of 32), s8 values "
                            "[n, k] or u8 values [n, k/2], f16 scales [n, k/32] (and f16 mins [n, k/32] "
                            f"with u8 values); got {', '.join(got)}")
    return "q8_0" if values.dtype == "s8" else ("q4_1" if mins is not None else "q4_0")


# GGML types with a kernel of their own on the file's bytes (Q8_0, Q4_0, Q4_1: matvec_blocks_kernel).
GGUF_KERNEL_TYPES = ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
# Those with an int8-activation kernel too (the _x8 targets): x rounded as llama.cpp rounds it
# for each form (its vec_dot_type), each block's product an integer sum: per 256 values (Q8_K)
# for the K-quants and IQ4_XS, per 32 (Q8_0; Q8_1, which keeps each 32's sum, for Q5_1) for
# Q5_0, Q5_1 and IQ4_NL.
GGUF_X8_KERNEL_TYPES = ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
# The row forms the int8-activation kernel of mixed rows takes: those, and Q8_0, Q4_0 and Q4_1
# (per 32 values, as Q5_0 and Q5_1).
GGUF_ROWS_X8_KERNEL_TYPES = GGUF_X8_KERNEL_TYPES + ("Q8_0", "Q4_0", "Q4_1")


def _gguf_target(name: str, int8_activations: bool, ggml_types: tuple[str, ...],
                 with_x8: tuple[str, ...] = GGUF_X8_KERNEL_TYPES) -> str:
    if int8_activations and not set(ggml_types) <= set(with_x8):
        raise HloShapeError(f"{name}: no int8-activation kernel for {'/'.join(ggml_types)} (those with one: "
                            f"{', '.join(with_x8)}); run it with int8_activations=False")
    return "_x8" if int8_activations else ""


def matvec_gguf_kernel(x: HloValue, data: HloValue, ggml_type: str,
                       int8_activations: bool = False, gemm: bool = False) -> HloValue:
    """x[..., k] (f32) @ w.T -> f32[..., n] by a CPU kernel, w[n, k] kept as a GGUF file stores
    it: rows of whole blocks of `ggml_type`, u8 [n, k / values * bytes] (pyhlo.ops.gguf_blocks
    has the layouts). Each block's values are the gguf package's reading of it (a K-quant's
    minimums applied through the sums of x) and the sums are f32; with int8_activations
    (GGUF_X8_KERNEL_TYPES), x is rounded to int8 as llama.cpp rounds it for the form (per 256
    values as its Q8_K, or per 32 as its Q8_0 / Q8_1) and each block's product is an integer
    sum (the _x8 targets). gemm (for many activation rows, a prefill; not with int8_activations,
    which has gemm_gguf_x8_kernel): the same exact product, each thread widening a panel of weight
    rows to f32 in its cache once for all activation rows (pyhlo_gemm_<type>,
    runtime/kernels/widened_panels.h). The kernel must be registered
    with the backend (runtime.cpu_kernels.register()) before a program using it is compiled."""
    from pyhlo.ops.gguf_blocks import LAYOUTS

    if not _gguf_operands_fit(x, data, ggml_type, GGUF_KERNEL_TYPES):
        values, size = LAYOUTS.get(ggml_type, (0, 0))
        raise HloShapeError(f"matvec_gguf_kernel: {ggml_type} needs f32 x[..., k] and u8 "
                            f"w[n, k / {values} * {size}]; got {x.dtype}{list(x.dims)} and "
                            f"{data.dtype}{list(data.dims)}")
    suffix = _gguf_target("matvec_gguf_kernel", int8_activations, (ggml_type,))
    shape = x.scribe.f32[(*x.dims[:-1], data.dims[0])]
    return ffi_call(shape, [x, data], f"{_gguf_product('matvec_gguf_kernel', gemm, int8_activations)}_"
                                      f"{ggml_type.lower()}{suffix}")


def _gguf_product(name: str, gemm: bool, int8_activations: bool) -> str:
    """The target's stem: the exact GEMM or the matrix-vector kernel."""
    if gemm and int8_activations:
        raise HloShapeError(f"{name}: gemm=True is the exact product; with int8 activations use "
                            "gemm_gguf_x8_kernel / gemm_gguf_rows_x8_kernel")
    return "pyhlo_gemm" if gemm else "pyhlo_matvec"


def _gguf_operands_fit(x: HloValue, data: HloValue, ggml_type: str, types: tuple[str, ...]) -> bool:
    """f32 x[..., k] and u8 data[n, k / values * bytes] of a GGUF type among `types`."""
    from pyhlo.ops.gguf_blocks import LAYOUTS

    values, size = LAYOUTS.get(ggml_type, (0, 0)) if ggml_type in types else (0, 0)
    k = x.dims[-1] if x.dims else -1
    return bool(size) and x.dtype == "f32" and data.dtype == "u8" and len(data.dims) == 2 \
        and data.dims[1] % size == 0 and data.dims[1] // size * values == k


# K-quants with an int8 GEMM for products of many activation rows (gemm_gguf_x8_kernel).
GGUF_GEMM_X8_KERNEL_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# Forms of 32-value blocks kept as the file's bytes with one (the block forms' int8 GEMM).
GGUF_GEMM32_X8_KERNEL_TYPES = ("Q5_0", "Q5_1", "IQ4_NL")
# The row forms the int8 GEMM of rows of mixed 32-value block forms takes (Q8_0, Q4_0 and Q4_1
# as the file's bytes too).
GGUF_ROWS32_GEMM_X8_KERNEL_TYPES = GGUF_GEMM32_X8_KERNEL_TYPES + ("Q8_0", "Q4_0", "Q4_1")


def gemm_gguf_x8_kernel(x: HloValue, data: HloValue, ggml_type: str) -> HloValue:
    """matvec_gguf_kernel(..., int8_activations=True) for many activation rows (a prefill): the
    same operands, the same rounding of x (per 256 values as llama.cpp's Q8_K for the K-quants,
    GGUF_GEMM_X8_KERNEL_TYPES, on runtime/kernels/gemm_kquants.cc; per 32 as its Q8_1 for Q5_0,
    Q5_1 and IQ4_NL, GGUF_GEMM32_X8_KERNEL_TYPES, on runtime/kernels/gemm_blocks.cc), the same
    integer sums per block, as a tiled integer GEMM; only the order of the f32 sums differs. The
    kernel must be registered with the backend (runtime.cpu_kernels.register()) before a program
    using it is compiled."""
    types = GGUF_GEMM_X8_KERNEL_TYPES + GGUF_GEMM32_X8_KERNEL_TYPES
    if not _gguf_operands_fit(x, data, ggml_type, types):
        raise HloShapeError(f"gemm_gguf_x8_kernel: needs f32 x[..., k] and u8 w[n, k / values * bytes] of "
                            f"whole blocks of one of {', '.join(types)}; got {ggml_type} with "
                            f"{x.dtype}{list(x.dims)} and {data.dtype}{list(data.dims)}")
    shape = x.scribe.f32[(*x.dims[:-1], data.dims[0])]
    return ffi_call(shape, [x, data], f"pyhlo_gemm_{ggml_type.lower()}_x8")


def gemm_gguf_rows_x8_kernel(x: HloValue, data: HloValue, ggml_types: tuple[str, ...]) -> HloValue:
    """matvec_gguf_rows_kernel(..., int8_activations=True) for many activation rows (a prefill) of a
    weight whose rows come in several forms (`ggml_types`), each row multiplied as its form is, as
    the tiled integer GEMMs of gemm_gguf_x8_kernel: K-quants alone (GGUF_GEMM_X8_KERNEL_TYPES;
    llama.cpp's Q4_K_M mixes Q4_K and Q6_K so), or forms of 32-value blocks alone
    (GGUF_ROWS32_GEMM_X8_KERNEL_TYPES; its Q4_K_M of a small model mixes Q5_0 and Q8_0). The
    kernel checks each row's code and offset when it runs."""
    from pyhlo.ops.gguf_blocks import mixed_rows_width

    k = x.dims[-1] if x.dims else -1
    types = set(ggml_types)
    if ggml_types and types <= set(GGUF_GEMM_X8_KERNEL_TYPES):
        values, target = 256, "pyhlo_gemm_gguf_rows_x8"
    elif ggml_types and types <= set(GGUF_ROWS32_GEMM_X8_KERNEL_TYPES):
        values, target = 32, "pyhlo_gemm_gguf_rows32_x8"
    else:
        raise HloShapeError(f"gemm_gguf_rows_x8_kernel: rows of {'/'.join(ggml_types)}: the GEMM takes "
                            f"rows of {', '.join(GGUF_GEMM_X8_KERNEL_TYPES)} alone or of "
                            f"{', '.join(GGUF_ROWS32_GEMM_X8_KERNEL_TYPES)} alone (others: "
                            "matvec_gguf_rows_kernel)")
    width = mixed_rows_width(ggml_types, k) if k > 0 and k % values == 0 else None
    if x.dtype != "f32" or data.dtype != "u8" or len(data.dims) != 2 or data.dims[1] != width:
        raise HloShapeError(f"gemm_gguf_rows_x8_kernel: rows of {'/'.join(ggml_types)} need f32 "
                            f"x[..., k] (k a multiple of {values}) and u8 w[n, widest row + 5]; got "
                            f"{x.dtype}{list(x.dims)} and {data.dtype}{list(data.dims)}")
    return ffi_call(x.scribe.f32[(*x.dims[:-1], data.dims[0])], [x, data], target)


def matvec_gguf_rows_kernel(x: HloValue, data: HloValue, ggml_types: tuple[str, ...],
                            int8_activations: bool = False, gemm: bool = False) -> HloValue:
    """x[..., k] (f32) @ w.T -> f32[..., n] by a CPU kernel, w[n, k] in rows of mixed GGUF forms
    (`ggml_types`), laid out by pyhlo.ops.gguf_blocks.pack_mixed_rows: u8 [n, widest row + 5],
    the rows back to back, then their offsets and forms' codes. The kernel checks each row's code
    and offset when it runs. int8_activations as matvec_gguf_kernel's, for rows of
    GGUF_ROWS_X8_KERNEL_TYPES: x is rounded once each way the rows' forms take it (per 256 values,
    per 32) and each row multiplied as its form is. gemm as matvec_gguf_kernel's."""
    from pyhlo.ops.gguf_blocks import mixed_rows_width

    k = x.dims[-1] if x.dims else -1
    width = mixed_rows_width(ggml_types, k)
    if x.dtype != "f32" or data.dtype != "u8" or len(data.dims) != 2 or data.dims[1] != width:
        raise HloShapeError(f"matvec_gguf_rows_kernel: rows of {'/'.join(ggml_types)} need f32 x[..., k] "
                            f"and u8 w[n, {width}]; got {x.dtype}{list(x.dims)} and "
                            f"{data.dtype}{list(data.dims)}")
    suffix = _gguf_target("matvec_gguf_rows_kernel", int8_activations, tuple(ggml_types),
                          GGUF_ROWS_X8_KERNEL_TYPES)
    target = _gguf_product("matvec_gguf_rows_kernel", gemm, int8_activations) + "_gguf_rows" + suffix
    return ffi_call(x.scribe.f32[(*x.dims[:-1], data.dims[0])], [x, data], target)
