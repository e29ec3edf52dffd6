"""Mixed precision: the low-precision element types, and widening them for accurate math.

The element type of an `amp` setting is pyhlo.dtypes.element_type_of_amp.
"""
from __future__ import annotations

from pyhlo.ops.elementwise import convert
from pyhlo.scribe import HloValue

LOW_PRECISION = frozenset({"bf16", "f16"})


def compute_in_f32(x: HloValue) -> HloValue:
    """bf16/f16 values widened to f32 for reductions and transcendental math; others unchanged."""
    return convert(x, "f32") if x.dtype in LOW_PRECISION else x
