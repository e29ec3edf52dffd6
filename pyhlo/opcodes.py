"""HLO opcodes the scribe writes, and the CamelCase op-method names that spell them.

`opcode_of("DynamicUpdateSlice")` is `"dynamic-update-slice"`. The opcode groups
here also tell shape_inference which rule an op follows.
"""
from __future__ import annotations

import re

# Elementwise ops whose result has the shape and type of their operand(s).
UNARY_SAME = {
    "abs", "negate", "exponential", "exponential-minus-one", "log", "log-plus-one", "sqrt",
    "rsqrt", "cbrt", "tanh", "logistic", "sine", "cosine", "tan", "floor", "ceil",
    "round-nearest-afz", "round-nearest-even", "sign", "not", "erf", "copy", "popcnt",
    "clz", "real", "imag", "opt-barrier",
}
BINARY_SAME = {
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "power", "remainder",
    "and", "or", "xor", "atan2", "shift-left", "shift-right-logical", "shift-right-arithmetic",
}
# Opcodes with no shape rule in shape_inference: XLA checks them when it compiles.
UNCHECKED = {
    "custom-call", "rng-bit-generator", "gather", "scatter", "while", "conditional", "call",
    "all-gather", "reduce-scatter", "all-to-all", "collective-permute", "rng", "after-all",
    "bitcast", "fusion", "map", "reverse", "reduce-precision",
}
KNOWN_OPCODES = (
    UNARY_SAME | BINARY_SAME | UNCHECKED | {
        "parameter", "constant", "compare", "select", "clamp", "convert", "bitcast-convert",
        "is-finite", "broadcast", "reshape", "transpose", "slice", "dynamic-slice",
        "dynamic-update-slice", "concatenate", "pad", "iota", "dot", "reduce", "reduce-window",
        "get-tuple-element", "tuple", "sort", "topk", "all-reduce", "replica-id", "partition-id",
    }
)

# CamelCase method names whose opcode is not the plain kebab-case spelling.
_OPCODE_ALIASES = {
    "Exp": "exponential",
    "Expm1": "exponential-minus-one",
    "Log1p": "log-plus-one",
    "Sin": "sine",
    "Cos": "cosine",
    "Pow": "power",
    "TopK": "topk",
    "Sigmoid": "logistic",
    "OptimizationBarrier": "opt-barrier",
    "OptBarrier": "opt-barrier",
}


def opcode_of(method_name: str) -> str:
    """`DynamicUpdateSlice` -> `dynamic-update-slice`; unknown names fail clearly."""
    opcode = _OPCODE_ALIASES.get(method_name) or re.sub(
        r"(?<!^)(?=[A-Z])", "-", method_name
    ).lower()
    if opcode not in KNOWN_OPCODES:
        raise AttributeError(f"unknown HLO op {method_name!r} (opcode {opcode!r})")
    return opcode
