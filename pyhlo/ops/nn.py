"""Neural-network composites: softmax, norms, activations, rotary embeddings, masks, ALiBi slopes.

Reductions and transcendental math run in f32 when the input is bf16 or f16;
results come back in the input's element type.
"""
from __future__ import annotations

import math

import numpy as np

from pyhlo.ops.custom_call import ffi_call
from pyhlo.ops.elementwise import (
    add,
    compare,
    constant,
    convert,
    divide,
    erf,
    exp,
    logistic,
    maximum,
    multiply,
    negate,
    rsqrt,
    subtract,
    tanh,
)
from pyhlo.ops.precision import compute_in_f32
from pyhlo.ops.reductions import reduce_max, reduce_sum
from pyhlo.ops.shape_ops import broadcast, concatenate, iota, reshape, slice_along
from pyhlo.scribe import HloValue
from pyhlo.shape_inference import HloShapeError


def expand(x: HloValue, dims: tuple[int, ...], dim: int) -> HloValue:
    """A value reduced over `dim` broadcast back to `dims` (the reduced dim repeats it)."""
    kept = [i for i in range(len(dims)) if i != dim]
    return broadcast(x, dims, kept)


def expand_last(x: HloValue, dims: tuple[int, ...]) -> HloValue:
    """A vector [n] broadcast along the last dim of `dims` (e.g. a norm weight onto [..., n])."""
    return broadcast(x, dims, [len(dims) - 1])


def softmax(x: HloValue, dim: int = -1) -> HloValue:
    """exp(x - max) / sum(exp(x - max)) along `dim`; f32 math for bf16/f16, x's type out."""
    dim %= len(x.dims)
    xf = compute_in_f32(x)
    shifted = subtract(xf, expand(reduce_max(xf, dim), xf.dims, dim))
    e = exp(shifted)
    return convert(divide(e, expand(reduce_sum(e, dim), e.dims, dim)), x.dtype)


def rms_norm(x: HloValue, weight: HloValue, eps: float, weight_offset: float = 0.0) -> HloValue:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim (HF LlamaRMSNorm).

    Normalized in f32, rounded to x's type, then scaled by the weight in x's type. With a
    `weight_offset` (Gemma's 1.0) it scales by (weight_offset + weight) in f32 before the
    rounding, as HF GemmaRMSNorm does.
    """
    last = len(x.dims) - 1
    xf = compute_in_f32(x)
    mean_square = divide(reduce_sum(multiply(xf, xf), last), float(x.dims[-1]))
    inv = rsqrt(add(mean_square, float(eps)))
    normed = multiply(xf, expand(inv, xf.dims, last))
    if weight_offset:
        scale = add(convert(weight, normed.dtype), float(weight_offset))
        return convert(multiply(normed, expand_last(scale, normed.dims)), x.dtype)
    return multiply(convert(normed, x.dtype), expand_last(convert(weight, x.dtype), x.dims))


def soft_cap(x: HloValue, cap: float) -> HloValue:
    """cap * tanh(x / cap): values squashed into (-cap, cap) (Gemma 2's attention scores and logits)."""
    return multiply(tanh(divide(x, float(cap))), float(cap))


def layer_norm(x: HloValue, weight: HloValue, bias: HloValue | None, eps: float) -> HloValue:
    """(x - mean) * rsqrt(var + eps) * weight + bias over the last dim; biased variance, f32 math."""
    last = len(x.dims) - 1
    n = float(x.dims[-1])
    xf = compute_in_f32(x)
    centered = subtract(xf, expand(divide(reduce_sum(xf, last), n), xf.dims, last))
    var = divide(reduce_sum(multiply(centered, centered), last), n)
    out = multiply(centered, expand(rsqrt(add(var, float(eps))), xf.dims, last))
    out = multiply(out, expand_last(convert(weight, xf.dtype), xf.dims))
    if bias is not None:
        out = add(out, expand_last(convert(bias, xf.dtype), xf.dims))
    return convert(out, x.dtype)


def gelu(x: HloValue, approximate: str = "none") -> HloValue:
    """0.5 x (1 + erf(x / sqrt 2)); approximate="tanh": 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    xf = compute_in_f32(x)
    if approximate == "none":
        inner = erf(multiply(xf, 1.0 / math.sqrt(2.0)))
    elif approximate == "tanh":
        cube = multiply(multiply(xf, xf), xf)
        inner = tanh(multiply(add(xf, multiply(cube, 0.044715)), math.sqrt(2.0 / math.pi)))
    else:
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return convert(multiply(multiply(xf, 0.5), add(inner, 1.0)), x.dtype)


def silu(x: HloValue) -> HloValue:
    """x * sigmoid(x) (a.k.a. swish)."""
    xf = compute_in_f32(x)
    return convert(multiply(xf, logistic(xf)), x.dtype)


def relu(x: HloValue) -> HloValue:
    """max(x, 0)."""
    return maximum(x, constant(x.scribe, x.dtype, 0.0))


def _gelu_tanh(x: HloValue) -> HloValue:
    return gelu(x, approximate="tanh")


# By the names Hugging Face configs use for them (hidden_act).
ACTIVATIONS = {
    "silu": silu,
    "swish": silu,
    "gelu": gelu,
    "gelu_tanh": _gelu_tanh,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "relu": relu,
}


def activation_fn(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; valid: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


# -- rotary position embeddings ------------------------------------------------

def _rotary_frequencies(inv_freq: np.ndarray, style: str) -> np.ndarray:
    inv_freq = np.asarray(inv_freq, dtype=np.float32).reshape(-1)
    if style == "half":
        return np.concatenate([inv_freq, inv_freq])
    if style == "interleaved":
        return np.repeat(inv_freq, 2)
    raise ValueError(f"rotary style must be 'half' or 'interleaved', got {style!r}")


def rotary_cos_sin(positions: HloValue, inv_freq: np.ndarray,
                   style: str = "half") -> tuple[HloValue, HloValue]:
    """f32 cos and sin of positions * inv_freq, shaped positions.dims + (head_dim,).

    "half" (HF Llama/NeoX) lays the frequencies out as cat(f, f); "interleaved"
    (GPT-J) repeats each one twice in adjacent slots.
    """
    freqs = _rotary_frequencies(inv_freq, style)
    scribe = positions.scribe
    dims = positions.dims + (len(freqs),)
    pos = broadcast(convert(positions, "f32"), dims, list(range(len(positions.dims))))
    angles = multiply(pos, expand_last(constant(scribe, "f32", freqs, (len(freqs),)), dims))
    return angles.shape.Cos(angles), angles.shape.Sin(angles)


def rotary_cos_sin_kernel(positions: HloValue, inv_freq: np.ndarray,
                          style: str = "half") -> tuple[HloValue, HloValue]:
    """rotary_cos_sin's tables by a CPU kernel (runtime/kernels/rotary.cc), computed once:
    XLA:CPU would evaluate the program's cos and sin again in every consumer, for every head.
    The kernel must be registered with the backend (runtime.cpu_kernels.register()) before
    compiling."""
    freqs = _rotary_frequencies(inv_freq, style)
    scribe = positions.scribe
    if positions.dtype != "s32":
        raise HloShapeError(f"rotary_cos_sin_kernel: positions must be s32, got {positions.dtype}")
    count = math.prod(positions.dims)
    tables = ffi_call(scribe.f32[2, count, len(freqs)],
                      [reshape(positions, (count,)), constant(scribe, "f32", freqs, (len(freqs),))],
                      "pyhlo_rotary_cos_sin")
    dims = positions.dims + (len(freqs),)
    return reshape(slice_along(tables, 0, 0, 1), dims), reshape(slice_along(tables, 0, 1, 2), dims)


def _rotate(x: HloValue, style: str) -> HloValue:
    """rotate_half: cat(-x2, x1); interleaved: (x[2i], x[2i+1]) -> (-x[2i+1], x[2i])."""
    last = len(x.dims) - 1
    head_dim = x.dims[-1]
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
    if style == "half":
        x1 = slice_along(x, last, 0, head_dim // 2)
        x2 = slice_along(x, last, head_dim // 2, head_dim)
        return concatenate([negate(x2), x1], last)
    if style == "interleaved":
        pairs = reshape(x, x.dims[:-1] + (head_dim // 2, 2))
        even = slice_along(pairs, last + 1, 0, 1)
        odd = slice_along(pairs, last + 1, 1, 2)
        return reshape(concatenate([negate(odd), even], last + 1), x.dims)
    raise ValueError(f"rotary style must be 'half' or 'interleaved', got {style!r}")


def apply_rotary(x: HloValue, cos: HloValue, sin: HloValue, style: str = "half") -> HloValue:
    """x * cos + rotate(x) * sin; cos/sin (f32) already have x's dims; f32 math, x's type out."""
    if cos.dims != x.dims or sin.dims != x.dims:
        raise ValueError(f"apply_rotary: cos {cos.shape!r} and sin {sin.shape!r} must have x's dims {x.dims}")
    xf = convert(x, "f32")
    out = add(multiply(xf, cos), multiply(_rotate(xf, style), sin))
    return convert(out, x.dtype)


def apply_rotary_partial(x: HloValue, cos: HloValue, sin: HloValue, rotary_dim: int,
                         style: str = "half") -> HloValue:
    """Rotate only the first `rotary_dim` features of x (GPT-NeoX / GPT-J partial rotary).

    cos/sin have x's dims with `rotary_dim` as the last one.
    """
    if rotary_dim == x.dims[-1]:
        return apply_rotary(x, cos, sin, style)
    last = len(x.dims) - 1
    rotated = apply_rotary(slice_along(x, last, 0, rotary_dim), cos, sin, style)
    return concatenate([rotated, slice_along(x, last, rotary_dim, x.dims[-1])], last)


# -- masks and position biases -------------------------------------------------

def causal_mask(query_positions: HloValue, n_keys: int, window: int | None = None) -> HloValue:
    """pred[..., n_q, n_keys]: true where key k is visible from a query at position pos.

    Visible means k <= pos and, with a sliding window, pos - k < window.
    """
    scribe = query_positions.scribe
    positions = convert(query_positions, "s32")
    dims = positions.dims + (n_keys,)
    pos = broadcast(positions, dims, list(range(len(positions.dims))))
    keys = iota(scribe, "s32", dims, len(dims) - 1)
    visible = compare(keys, pos, "LE")
    if window is not None:
        in_window = compare(subtract(pos, keys), int(window), "LT")
        visible = scribe.pred[dims].And(visible, in_window)
    return visible


def alibi_slopes(n_heads: int) -> np.ndarray:
    """ALiBi head slopes (f32), including the interleaved extras for non-power-of-two head counts."""
    closest = 2 ** math.floor(math.log2(n_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base ** p for p in range(1, closest + 1)]
    if closest != n_heads:
        extra_base = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        remaining = min(closest, n_heads - closest)
        slopes += [extra_base ** p for p in range(1, 1 + 2 * remaining, 2)]
    return np.asarray(slopes, dtype=np.float32)
