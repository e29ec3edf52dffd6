"""The forms a linear weight is stored in for the programs, and what each form's arrays are.

A weight quantized at load (NeuronConfig.quant) is int8 [out, in] with one f32 scale per
output row ("s8", `QuantizedWeight`). A weight a GGUF file stores in one of llama.cpp's block
forms runs as stored (`BlockWeight`), dequantized inside the program or pyhlo's CPU kernel:
Q8_0, Q4_0 and Q4_1 as the same bits split into values, scales and minimums (each row in blocks
of 32 values that share an f16 scale and minimum); Q5_0, Q5_1, IQ4_NL and the K-quants and
IQ4_XS (super-blocks of 256 values with 4- to 8-bit sub-block scales) as the file's own
bytes, one u8 array of whole blocks per row, unpacked in the program
(pyhlo/ops/gguf_blocks.py) or the kernel. BLOCK_FORMS lists those forms, one row each; a new
form starts with a row there.

A leaf: the pieces' declarations, the checkpoints and the lowering all import it, and it
imports none of them.
"""
from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np

from pyhlo.ops import quantized
from pyhlo.ops.gguf_blocks import mixed_rows_width, pack_mixed_rows

# Values per block of the block forms below (each block has its own scale): the block the
# programs dequantize.
BLOCK = quantized.BLOCK


class BlockForm(NamedTuple):
    """A GGUF block form run as stored: how its values are held, and its blocks in a file."""

    values_dtype: str       # the element type of the values array ("s8", "u8")
    values_per_byte: int    # 2 for 4-bit values: byte j of a block's 16 holds values j and j + 16
    ggml_type: str          # the GGML type a GGUF file names it by
    block_bytes: int        # one block in a GGUF file: f16 scale, f16 minimum (if any), values
    has_mins: bool          # a minimum per block: w = scale * value + min (else scale * value)
    # Values per block: 32, or 256 for a K-quant's super-block.
    block_values: int = BLOCK
    # Kept as the file's bytes: `values` is u8 [out, in / block_values * block_bytes], whole
    # blocks, with no separate scales or minimums (values_per_byte and has_mins say nothing).
    as_file: bool = False


BLOCK_FORMS = {
    "q8_0": BlockForm("s8", 1, "Q8_0", 34, False),
    "q4_0": BlockForm("u8", 2, "Q4_0", 18, False),
    "q4_1": BlockForm("u8", 2, "Q4_1", 20, True),
    # d, then 32 high bits, then 16 bytes of low nibbles (Q5_1: d, m, high bits, nibbles).
    "q5_0": BlockForm("u8", 0, "Q5_0", 22, False, BLOCK, True),
    "q5_1": BlockForm("u8", 0, "Q5_1", 24, True, BLOCK, True),
    # K-quants (pyhlo/ops/gguf_blocks.py has each layout). Q2_K, Q3_K: 16 sub-blocks of 16.
    "q2_k": BlockForm("u8", 0, "Q2_K", 84, True, 256, True),
    "q3_k": BlockForm("u8", 0, "Q3_K", 110, False, 256, True),
    # Super-blocks of 8 sub-blocks of 32: d, dmin, 12 bytes of 6-bit scales and minimums,
    # (Q5_K: 32 bytes of high bits,) 128 bytes of nibbles.
    "q4_k": BlockForm("u8", 0, "Q4_K", 144, True, 256, True),
    "q5_k": BlockForm("u8", 0, "Q5_K", 176, True, 256, True),
    # 16 sub-blocks of 16: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 s8 scales, d.
    "q6_k": BlockForm("u8", 0, "Q6_K", 210, False, 256, True),
    # 4-bit indices into a table of 16 values: blocks of 32 with an f16 scale (IQ4_NL), or
    # super-blocks of 256 with 6-bit sub-block scales (IQ4_XS).
    "iq4_nl": BlockForm("u8", 0, "IQ4_NL", 18, False, BLOCK, True),
    "iq4_xs": BlockForm("u8", 0, "IQ4_XS", 136, False, 256, True),
}

# A weight whose rows come in several of the forms above (llama.cpp's Q4_K_M gives the layers
# of one weight different types, and a fused q|k|v may join them): "rows:q4_k+q6_k", one u8
# array [out, widest row + 5], each row in its own form as the file's bytes, the rows back to
# back, then their offsets and forms' codes (pyhlo/ops/gguf_blocks.py: pack_mixed_rows).
ROWS = "rows:"
ROWS_FORM = BlockForm("u8", 0, "", 0, False, BLOCK, True)


def rows_form(forms) -> str:
    """The form of a weight whose rows are in `forms`."""
    return ROWS + "+".join(sorted(forms))


def forms_of(quant: str) -> tuple[str, ...]:
    """The forms of a weight's rows: one, or those a rows form names."""
    return tuple(quant[len(ROWS):].split("+")) if quant.startswith(ROWS) else (quant,)


def is_block_form(quant: str | None) -> bool:
    return quant is not None and (quant in BLOCK_FORMS or quant.startswith(ROWS))


def block_form(quant: str) -> BlockForm:
    """The BLOCK_FORMS row of a form; for a rows form, one kept as (padded) file bytes."""
    return ROWS_FORM if quant.startswith(ROWS) else BLOCK_FORMS[quant]


class QuantizedWeight(NamedTuple):
    """A linear weight [out, in] as int8 values and f32 per-row scales."""

    values: np.ndarray
    scales: np.ndarray


class BlockWeight(NamedTuple):
    """A linear weight [out, in] in a GGUF block form: `values` s8 [out, in] (q8_0) or u8
    [out, in/2] (q4_0, q4_1: byte j of a block's 16 holds value j in its low nibble and
    value j+16 in its high one), `scales` f16 [out, in/32], `mins` f16 [out, in/32] (q4_1);
    for a form kept as the file's bytes, `values` u8 [out, whole blocks' bytes] alone."""

    form: str
    values: np.ndarray
    scales: np.ndarray | None = None
    mins: np.ndarray | None = None


class Stored(Protocol):
    """What the stored form of a declared parameter (decoders.blocks.params.Param) depends on."""

    shape: tuple[int, ...]
    quant: str | None
    part_of: str | None


def stored_dims(param: Stored) -> tuple[int, ...]:
    """The dims of a parameter as stored: a GGUF block weight's values are [out, in / values
    per byte]; anything else, its logical shape."""
    if is_block_form(param.quant) and not param.part_of:
        if param.quant.startswith(ROWS):
            return (param.shape[0], rows_width(param.quant, param.shape[1]))
        form = BLOCK_FORMS[param.quant]
        if form.as_file:
            return (param.shape[0], param.shape[1] // form.block_values * form.block_bytes)
        return (param.shape[0], param.shape[1] // form.values_per_byte)
    return param.shape


def stored_dtype(param: Stored) -> str | None:
    """The element type of a quantized weight or one of its arrays; None: not quantized."""
    if param.quant is None:
        return None
    if param.quant == "s8":
        return "f32" if param.part_of else "s8"
    return "f16" if param.part_of else block_form(param.quant).values_dtype


def ggml_types(quant: str) -> tuple[str, ...]:
    """The GGML types of a weight's rows."""
    return tuple(BLOCK_FORMS[form].ggml_type for form in forms_of(quant))


def rows_width(quant: str, k: int) -> int:
    """The second dimension of a rows form's array of rows of k values."""
    return mixed_rows_width(ggml_types(quant), k)


def file_bytes(weight: BlockWeight) -> np.ndarray:
    """A block weight's rows as the file stores them, u8 [out, row bytes]: the split forms'
    blocks put back together (f16 scale, f16 minimum if any, values)."""
    if BLOCK_FORMS[weight.form].as_file:
        return weight.values
    rows, blocks = weight.scales.shape
    parts = [a.reshape(rows, blocks, -1).view(np.uint8) for a in (weight.scales, weight.mins, weight.values)
             if a is not None]
    return np.concatenate(parts, axis=2).reshape(rows, -1)


def in_rows_form(weights: list[BlockWeight], quant: str, k: int) -> BlockWeight:
    """Block weights of any forms of `quant` joined by rows into that rows form."""
    rows = [(BLOCK_FORMS[weight.form].ggml_type, file_bytes(weight)) for weight in weights]
    return BlockWeight(quant, pack_mixed_rows(rows, k, ggml_types(quant)))
