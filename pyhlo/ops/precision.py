"""Mixed precision: element type names for an `amp` setting, and the casts between them."""
from __future__ import annotations

from pyhlo.ops.elementwise import convert
from pyhlo.scribe import HloValue

LOW_PRECISION = frozenset({"bf16", "f16"})

_AMP_NAMES = {
    "f32": "f32", "float32": "f32", "fp32": "f32",
    "bf16": "bf16", "bfloat16": "bf16",
    "f16": "f16", "float16": "f16", "fp16": "f16",
}


def compute_dtype(amp: str) -> str:
    """The element type name for an `amp` setting: 'bf16' and 'bfloat16' both give 'bf16'."""
    name = _AMP_NAMES.get(amp.lower()) if isinstance(amp, str) else None
    if name is None:
        raise ValueError(f"unknown amp dtype {amp!r}; valid names: {', '.join(sorted(_AMP_NAMES))}")
    return name


def upcast(x: HloValue, dtype: str = "f32") -> HloValue:
    """x widened to `dtype` for accurate math (a no-op when x already is `dtype`)."""
    return convert(x, dtype)


def downcast(x: HloValue, dtype: str) -> HloValue:
    """x rounded to `dtype` (a no-op when x already is `dtype`)."""
    return convert(x, dtype)


def compute_in_f32(x: HloValue) -> HloValue:
    """bf16/f16 values widened to f32 for reductions and transcendental math; others unchanged."""
    return convert(x, "f32") if x.dtype in LOW_PRECISION else x
