"""Which of a GGUF file's linear weights run in their block form as stored (BLOCK_FORMS in
decoders/weights/stored.py), and which are widened to the model's type at load; one log line
says so, once for each GGML type, with the memory the widening costs."""
from __future__ import annotations

import logging
from collections import Counter

import numpy as np

from decoders.blocks.params import Kind, Param
from decoders.weights.stored import BLOCK_FORMS, rows_form
from pyhlo.dtypes import byte_size
from pyhlo.ops.gguf_blocks import mixed_rows_width, row_bytes

log = logging.getLogger("pyhlo")
progress = logging.getLogger("pyhlo.progress")

FLOAT_TYPES = (None, "F32", "F16", "BF16")


def gguf_block_forms(checkpoint, layer_params: list[Param], head_params: list[Param], n_layers: int,
                     dtype: str = "f32") -> dict[str, str]:
    """The linear weights `checkpoint` stores in one GGUF block form in every layer (and the LM
    head), by parameter name: those run as stored. The quantized ones widened to `dtype` at
    load instead (other GGML types, or a form that differs between layers) are logged."""
    forms = {}
    kept, widened, why = Counter(), Counter(), {}     # tensors by GGML type; why widened
    extra_bytes = 0                                   # widened in `dtype` less their blocks
    padding = 0                                       # rows of mixed forms: room left unused
    for param, layers in [(p, range(n_layers)) for p in layer_params] + [(p, [None]) for p in head_params]:
        if param.kind is not Kind.LINEAR:
            continue
        names = [name for layer in layers for name in param.source.resolve(layer, checkpoint.__contains__)]
        types = {name: checkpoint.quant_type(name) for name in names if name in checkpoint}
        found = {checkpoint.block_form(name) for name in types}
        whole_blocks = not param.source.transforms and all(
            param.shape[1] % BLOCK_FORMS[form].block_values == 0 for form in found if form is not None)
        if found and None not in found and whole_blocks:
            # One form; or several (types that differ between layers, a fused q|k|v of
            # different types): each row kept in its own (pack_mixed_rows).
            forms[param.name] = found.pop() if len(found) == 1 else rows_form(found)
            kept.update(types.values())
            if len(found) > 1:
                padding += _padding(checkpoint, types, param.shape[1])
            continue
        for name, kind in types.items():
            if kind in FLOAT_TYPES:
                continue
            widened[kind] += 1
            values = int(np.prod(checkpoint.shape(name)))
            extra_bytes += values * byte_size(dtype) - _stored_bytes(kind, values)
            why.setdefault(kind, "not kept as stored" if checkpoint.block_form(name) is None
                           else "rows not whole blocks")
    _report(kept, widened, why, dtype, extra_bytes, padding)
    return forms


def _padding(checkpoint, types: dict[str, str], k: int) -> int:
    """Bytes a rows form of these tensors holds beyond their blocks (each layer's array has
    room for rows all of the widest form, and each row's offset and code)."""
    width = mixed_rows_width(tuple(types.values()), k)
    return sum((width - row_bytes(kind, k)) * checkpoint.shape(name)[0] for name, kind in types.items())


def _stored_bytes(kind: str, values: int) -> int:
    import gguf

    block_values, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    return values // block_values * block_bytes


def _report(kept: Counter, widened: Counter, why: dict, dtype: str, extra_bytes: int, padding: int) -> None:
    """One line, each GGML type once: kept as stored, widened, or partly each (and why), and
    what the widening and the padding of rows of mixed forms cost."""
    if not kept and not widened:
        return
    parts = []
    for kind in sorted(set(kept) | set(widened)):
        if not widened[kind]:
            parts.append(f"{kind} x{kept[kind]} kept as stored")
        elif not kept[kind]:
            parts.append(f"{kind} x{widened[kind]} widened to {dtype} ({why[kind]})")
        else:
            parts.append(f"{kind} x{kept[kind]} kept as stored and x{widened[kind]} widened to {dtype} "
                         f"({why[kind]})")
    line = "GGUF linear weights: " + ", ".join(parts)
    if padding:
        line += (f"; weights whose types differ between layers keep each row in its own form, "
                 f"with room for the widest: {padding / 1e6:.1f} MB unused")
    if widened:
        log.warning("%s; the widening costs %.1f MB more than the file's blocks", line, extra_bytes / 1e6)
    else:
        progress.info("%s", line)
