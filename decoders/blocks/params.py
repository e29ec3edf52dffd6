"""The one declaration of a parameter: its name, shape, tensor-parallel axis and checkpoint source.

Every piece of the decoder (norm, attention, MLP, embedding, head) declares its weights as
`Param`s. The program builder turns them into program parameters (through the lowering,
which picks the layout and element type), the loader reads them from a checkpoint with
their `Source`, the inspect tool lists them, and tensor parallelism shards them along
their `Shard` axis. Shapes are logical and torch-like: a linear weight is [out, in].
`declare_quantized` stores linear weights quantized, each followed by its scales (and minimums).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Callable

import ml_dtypes
import numpy as np

from decoders.checkpoints.base import is_float_dtype
from decoders.config import QuantizationConfig
from decoders.weights.stored import BLOCK, BLOCK_FORMS, ROWS, block_form, forms_of, in_rows_form


class Shard(enum.Enum):
    """How tensor parallelism splits a parameter over devices."""

    COLUMN = "column"          # linear weights split along `out` (and their biases)
    ROW = "row"                # linear weights split along `in`; outputs are summed (all-reduce)
    REPLICATED = "replicated"  # every device holds all of it (norms, output biases)
    VOCAB = "vocab"            # split along the vocabulary (LM head rows)


class Kind(enum.Enum):
    LINEAR = "linear"    # [out, in]; the lowering chooses [in, out] or [out, in] for the program
    VECTOR = "vector"    # [n]: norm weights and biases
    TABLE = "table"      # [rows, width]: embedding tables, read by row


Transform = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Source:
    """Where a parameter comes from in a checkpoint.

    `names` are tensor name templates ({i} is the layer index); each entry is one name or a
    tuple of alternatives, the first present being read (e.g. ("lm_head.weight",
    "embed_out.weight")). Several entries are concatenated along axis 0, then `transforms`
    apply in order.
    """

    names: tuple[str | tuple[str, ...], ...]
    transforms: tuple[Transform, ...] = ()

    def resolve(self, layer: int | None, present: Callable[[str], bool]) -> list[str]:
        """The tensor names to read for `layer`."""
        resolved = []
        for entry in self.names:
            options = (entry,) if isinstance(entry, str) else entry
            names = [option.format(i=layer) for option in options]
            # As HF's loader does, a checkpoint of the base model may lack the prefix
            # ("h.0.mlp..." for "transformer.h.0.mlp...").
            names += [n.split(".", 1)[1] for n in names if "." in n]
            resolved.append(next((n for n in names if present(n)), names[0]))
        return resolved

    @property
    def label(self) -> str:
        """The names read and the transforms applied, in one line ("a | b + c -> transpose"), as
        `pyhlo inspect` shows them."""
        parts = [n if isinstance(n, str) else " | ".join(n) for n in self.names]
        text = " + ".join(parts)
        for transform in self.transforms:
            text += f" -> {getattr(transform, 'label', transform.__name__)}"
        return text


@dataclass(frozen=True)
class Param:
    """A parameter of a piece: `name` is its program parameter name within a layer (or the
    model's shared parameters)."""

    name: str
    kind: Kind
    shape: tuple[int, ...]
    shard: Shard
    source: Source
    # A weight fused along `out` from parts (q|k|v, gate|up): sizes of the parts, which
    # tensor parallelism shards one by one (a fused block cannot be split by plain columns).
    segments: tuple[int, ...] = ()
    # The LM head: its element type is the lowering's head type, not the amp type.
    is_head: bool = False
    # Tensor parallelism splits the sharded axis in whole units of this many rows (head_dim
    # for attention projections: a head is never split).
    unit: int = 1
    # Attention projections: each part is this many KV-head groups of heads (the KV heads
    # themselves, or the query heads that share each). Tensor parallelism pads the groups to
    # a number the devices split (parallel/kv_sharding.py: padded_groups), with zero heads.
    head_groups: int = 0
    # Attention projections: the parts (indices into segments; (0,) for a lone k or v weight)
    # that hold keys or values, which some KV shardings hold whole or split by features.
    kv_segments: tuple[int, ...] = ()
    # Weight quantization (declare_quantized; the forms: decoders/weights/stored.py): the form
    # this linear weight is stored in ("s8": int8 per-row; a GGUF block form: "q8_0", "q4_0",
    # "q4_1"), or the quantized weight named `part_of` this array (its scales or minimums)
    # belongs to, read from the same tensor.
    quant: str | None = None
    part_of: str | None = None

    def __post_init__(self) -> None:
        if self.segments and sum(self.segments) != self.shape[0]:
            raise ValueError(f"{self.name}: segments {self.segments} do not add up to {self.shape[0]}")


def declare_quantized(params: list[Param], config: QuantizationConfig | None,
                      blocks: dict[str, str] | None = None) -> list[Param]:
    """Parameters with each linear weight stored quantized, followed by the arrays that
    belong to it (NAME.scale, NAME.min): in the GGUF block form `blocks` names for it, else,
    for a layer weight `config` quantizes, int8 with its f32 scales [out] (split with the
    weight's rows, whole beside a weight split by columns)."""
    declared = []
    for param in params:
        form = (blocks or {}).get(param.name)
        if form is not None and block_form(form).as_file:
            declared.append(replace(param, quant=form))     # one array: the file's blocks
            continue
        if form is not None:
            weight = replace(param, quant=form)
            width = param.shape[1] // BLOCK
            declared += [weight, replace(weight, name=f"{param.name}.scale", kind=Kind.TABLE,
                                         shape=(param.shape[0], width), part_of=param.name)]
            if BLOCK_FORMS[form].has_mins:
                declared.append(replace(weight, name=f"{param.name}.min", kind=Kind.TABLE,
                                        shape=(param.shape[0], width), part_of=param.name))
            continue
        quantized = config is not None and param.kind is Kind.LINEAR and not param.is_head
        if not quantized or not config.quantizes(param.name):
            declared.append(param)
            continue
        weight = replace(param, quant="s8")
        shard = Shard.REPLICATED if param.shard is Shard.ROW else param.shard
        declared += [weight, replace(weight, name=f"{param.name}.scale", kind=Kind.VECTOR,
                                     shape=param.shape[:1], shard=shard, part_of=param.name)]
    return declared


def labelled(label: str, transform: Transform) -> Transform:
    transform.label = label  # type: ignore[attr-defined]
    return transform


def per_head_qkv(n_heads: int, head_dim: int) -> Transform:
    """[heads x (q, k, v) x head_dim, ...] (GPT-NeoX, Bloom) -> [q | k | v, ...]."""

    def reorder(array: np.ndarray) -> np.ndarray:
        rest = array.shape[1:]
        return array.reshape(n_heads, 3, head_dim, *rest).swapaxes(0, 1).reshape(array.shape)

    return labelled(f"per-head qkv ({n_heads} heads) to q|k|v", reorder)


def rows(start: int, stop: int) -> Transform:
    """Rows start:stop (one part of a fused weight)."""
    return labelled(f"rows {start}:{stop}", lambda array: array[start:stop])


def transposed() -> Transform:
    """[in, out] (GPT-2's Conv1D) -> [out, in]."""
    return labelled("transpose", lambda array: array.T)


# Float types a weight is read in as stored: the lowering converts it once, to the program's
# type, as it places it (none where they agree: a bf16 checkpoint of a bf16 model).
KEPT_FLOATS = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def read(param: Param, checkpoint, layer: int | None) -> np.ndarray:
    """The parameter's array, in its logical shape: floats as stored where they are f32, f16 or
    bf16 (else f32), f32 for a weight quantized to int8 at load; for an array that belongs to a
    quantized weight (`part_of`), the weight's array it is computed from; for a weight in a
    GGUF block form (and its arrays), its blocks as the checkpoint stores them."""
    names = param.source.resolve(layer, checkpoint.__contains__)
    if param.quant not in (None, "s8"):
        return _read_blocks(param, checkpoint, names)
    # One array as stored (a view of a mapped file where the parts lie there in order), so that
    # a weight placed as stored is never copied on the host.
    array = checkpoint.rows(names)
    if array is None:                       # parts of different types: each widened to f32
        parts = [_widened(checkpoint.get(name, keep_dtype=True)) for name in names]
        array = np.concatenate(parts, axis=0)
    elif param.quant == "s8" or array.dtype not in KEPT_FLOATS:
        array = _widened(array)
    for transform in param.source.transforms:
        array = transform(array)
    if param.part_of and array.ndim == 2 and array.shape[0] == param.shape[0]:
        return array
    if tuple(array.shape) != param.shape:
        raise ValueError(f"{param.name}: {' + '.join(names)} gives shape {tuple(array.shape)}, "
                         f"expected {param.shape}")
    return array


def _widened(array: np.ndarray) -> np.ndarray:
    return array.astype(np.float32) if is_float_dtype(array.dtype) and array.dtype != np.float32 else array


def _read_blocks(param: Param, checkpoint, names: list[str]):
    """A GGUF block weight's parts concatenated along rows (a fused q|k|v is three tensors)."""
    stored = [checkpoint.block_form(name) for name in names]
    if None in stored:
        checkpoint.blocks(names[stored.index(None)])        # raises, naming the type it has instead
    forms = set(stored)
    if param.quant.startswith(ROWS) and forms <= set(forms_of(param.quant)) and not param.source.transforms:
        return in_rows_form([checkpoint.blocks(name) for name in names], param.quant, param.shape[1])
    if forms != {param.quant} or param.source.transforms:
        raise ValueError(f"{param.name}: {' + '.join(names)} are stored {sorted(forms)}, declared "
                         f"{param.quant!r}"
                         + (" with transforms" if param.source.transforms else ""))
    return checkpoint.blocks_rows(names)
