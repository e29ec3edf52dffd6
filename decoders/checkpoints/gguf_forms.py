"""Which of a GGUF file's linear weights run in their block form as stored (BLOCK_FORMS in
decoders/weights/stored.py), and which are widened to the model's type at load."""
from __future__ import annotations

import logging

from decoders.blocks.params import Kind, Param
from decoders.weights.stored import BLOCK_FORMS

log = logging.getLogger("pyhlo")


def gguf_block_forms(checkpoint, layer_params: list[Param], head_params: list[Param], n_layers: int
                     ) -> dict[str, str]:
    """The linear weights `checkpoint` stores in one GGUF block form in every layer (and the LM
    head), by parameter name: those run as stored. Logs the quantized ones that are widened at
    load instead (other GGML types, or a form that differs between layers)."""
    forms, widened = {}, set()
    for param, layers in [(p, range(n_layers)) for p in layer_params] + [(p, [None]) for p in head_params]:
        if param.kind is not Kind.LINEAR:
            continue
        names = [name for layer in layers for name in param.source.resolve(layer, checkpoint.__contains__)]
        found = {checkpoint.block_form(name) for name in names if name in checkpoint}
        whole_blocks = not param.source.transforms and all(
            param.shape[1] % BLOCK_FORMS[form].block_values == 0 for form in found if form is not None)
        if len(found) == 1 and None not in found and whole_blocks:
            forms[param.name] = found.pop()
            continue
        types = {checkpoint.quant_type(name) for name in names if name in checkpoint}
        widened |= {t for t in types if t not in (None, "F32", "F16", "BF16")}
        widened |= {"mixed"} if len(found) > 1 else set()
    if widened:
        log.info("GGUF weights stored %s are widened at load; Q8_0, Q4_0 and Q4_1 run as stored",
                 ", ".join(sorted(widened)))
    return forms
