"""Embedding and LM head pieces.

Embedding: token table rows, plus optional learned positions (GPT-2, OPT with its offset of
2) and an embedding norm (Bloom). Head: an optional final norm and the vocabulary projection
(optionally with a bias: GPT-J) of one position per line; with tied embeddings its weight is
the token table. A token table narrower than the layers (OPT-350m's word_embed_proj_dim) is
projected in by the embedding and out by the head.

When the LM head is the token table in the same element type, the model keeps one table
(`Head.params` declares it; the embedding reads its rows, or its columns in [in, out]).

Under tensor parallelism the head is split by vocabulary rows and its logits stay split:
replica r returns the logits of its block of rows, r * w .. r * w + w - 1 (replica.block_start).
"""
from __future__ import annotations

from dataclasses import dataclass

from decoders.blocks.norm import Norm
from decoders.blocks.params import Kind, Param, Shard, Source
from decoders.blocks.values import PieceValues
from decoders.parallel import replica
from pyhlo.ops import elementwise as ew
from pyhlo.ops import nn
from pyhlo.ops.gguf_blocks import dequantize_gguf
from pyhlo.ops.quantized import dequantize_blocks
from pyhlo.ops.shape_ops import concatenate, dynamic_slice, iota, reshape, transpose
from pyhlo.scribe import HloValue

TOKENS = "embed.tokens"
HEAD_WEIGHT = "lm_head.weight"


@dataclass(frozen=True)
class Embedding:
    tokens: str                       # checkpoint name of the token table [vocab, hidden]
    vocab_size: int
    hidden: int
    positions: str | None = None      # checkpoint name of a learned position table
    n_positions: int = 0              # its rows
    position_offset: int = 0          # OPT: position p reads row p + 2
    norm: Norm | None = None          # Bloom's word_embeddings_layernorm
    # A token table `width` wide, projected to `hidden` by this linear's weight [hidden, width]
    # (OPT's project_in); None: the table is `hidden` wide.
    projection: str | None = None
    width: int | None = None
    # Token rows multiplied by this (Gemma: sqrt(hidden)), the factor rounded to the amp type as
    # HF rounds it to the table's type (a bf16 Gemma 2B's sqrt(2048) is 45.25).
    scale: float | None = None

    def __post_init__(self) -> None:
        if (self.projection is None) != (self.width is None):
            raise ValueError("an embedding projection needs the token table's width, and only it does")

    @property
    def table_width(self) -> int:
        return self.hidden if self.width is None else self.width

    def params(self, scope: str = "embed", include_tokens: bool = True) -> list[Param]:
        declared = []
        if include_tokens:
            declared.append(Param(f"{scope}.tokens", Kind.TABLE, (self.vocab_size, self.table_width),
                                  Shard.REPLICATED, Source((self.tokens,))))
        if self.projection is not None:
            declared.append(Param(f"{scope}.project.weight", Kind.LINEAR, (self.hidden, self.table_width),
                                  Shard.REPLICATED, Source((f"{self.projection}.weight",))))
        if self.positions is not None:
            declared.append(Param(f"{scope}.positions", Kind.TABLE, (self.n_positions, self.hidden),
                                  Shard.REPLICATED, Source((self.positions,))))
        if self.norm is not None:
            declared += self.norm.params(f"{scope}.norm")
        return declared

    def __call__(self, values: PieceValues, table: HloValue, ids: HloValue, positions: HloValue | None,
                 dtype: str, table_scales: HloValue | None = None,
                 table_mins: HloValue | None = None, table_ggml_type: str | None = None) -> HloValue:
        """Hidden states [b, n, hidden] (dtype) of token ids [b, n]; `table` is the token table
        [vocab, hidden], or the LM head [hidden, vocab] when it serves as the table, or the LM
        head's GGUF block values with their `table_scales` (and `table_mins`), or its rows of
        GGUF blocks as the file stores them, of `table_ggml_type`."""
        if table_ggml_type is not None:
            b, n = ids.dims
            rows = reshape(_rows(table, ids, table.dims[1]), (b * n, table.dims[1]))
            hidden = reshape(dequantize_gguf(rows, table_ggml_type, dtype), (b, n, self.table_width))
        elif table_scales is None:
            hidden = ew.convert(_rows(table, ids, self.table_width), dtype)
        else:
            hidden = _block_rows(ids, self.table_width, dtype, table, table_scales, table_mins)
        if self.scale is not None:
            hidden = ew.multiply(hidden, self.scale)
        if self.projection is not None:
            hidden = values.linear(hidden, "project")
        if self.positions is not None:
            rows = ew.add(positions, self.position_offset) if self.position_offset else positions
            hidden = ew.add(hidden, ew.convert(_rows(values["positions"], rows, self.hidden), dtype))
        if self.norm is not None:
            hidden = self.norm(values.scoped("norm", self.norm), hidden)
        return hidden


def _block_rows(ids: HloValue, width: int, dtype: str, *parts: HloValue | None) -> HloValue:
    """Rows `ids` [b, n] of a table in GGUF blocks, widened: [b, n, width] in dtype."""
    b, n = ids.dims
    rows = [None if part is None else reshape(_rows(part, ids, part.dims[1]), (b * n, part.dims[1]))
            for part in parts]
    return reshape(dequantize_blocks(*rows, dtype=dtype), (b, n, width))


def _rows(table: HloValue, ids: HloValue, width: int) -> HloValue:
    """table[ids] as [b, n, width]: rows of a [rows, width] table, or columns of [width, rows]."""
    b, n = ids.dims
    shape = getattr(table.scribe, table.dtype)
    if table.dims[0] == width and table.dims[1] != width:
        numbers = dict(offset_dims=[0], collapsed_slice_dims=[1], start_index_map=[1], index_vector_dim=2)
        columns = shape[width, b, n].Gather(table, ids, gather_dimension_numbers=numbers,
                                            gather_slice_sizes=[width, 1])
        return transpose(columns, (1, 2, 0))
    numbers = dict(offset_dims=[2], collapsed_slice_dims=[0], start_index_map=[0], index_vector_dim=2)
    return shape[b, n, width].Gather(table, ids, gather_dimension_numbers=numbers,
                                     gather_slice_sizes=[1, width])


@dataclass(frozen=True)
class Head:
    """Final norm (None: none, as OPT-350m) and LM head. `weight` is the checkpoint name (or
    alternatives) of the head; None: tied to the embedding's token table, `tied_to`. `bias`
    names the head's bias (GPT-J). `projection` names a linear [width, hidden] between the
    norm and a head `width` wide (OPT's project_out)."""

    norm: Norm | None
    vocab_size: int
    hidden: int
    weight: str | tuple[str, ...] | None
    tied_to: str = ""
    bias: str | None = None
    projection: str | None = None
    width: int | None = None
    # Logits soft-capped to (-softcap, softcap): softcap * tanh(logits / softcap) (Gemma 2).
    softcap: float | None = None

    def __post_init__(self) -> None:
        if (self.projection is None) != (self.width is None):
            raise ValueError("a head projection needs the head's width, and only it does")

    def params(self) -> list[Param]:
        width = self.hidden if self.width is None else self.width
        declared = self.norm.params("final_norm") if self.norm is not None else []
        if self.projection is not None:
            declared.append(Param("project_out.weight", Kind.LINEAR, (width, self.hidden), Shard.REPLICATED,
                                  Source((f"{self.projection}.weight",))))
        source = Source((self.weight if self.weight is not None else self.tied_to,))
        declared.append(Param(HEAD_WEIGHT, Kind.LINEAR, (self.vocab_size, width), Shard.VOCAB, source,
                              is_head=True))
        if self.bias is not None:
            # In the head's element type: added to its f32 logits.
            declared.append(Param("lm_head.bias", Kind.VECTOR, (self.vocab_size,), Shard.VOCAB,
                                  Source((self.bias,)), is_head=True))
        return declared

    def __call__(self, values: PieceValues, hidden: HloValue, last_index: HloValue) -> HloValue:
        """f32 logits [b, vocab] of position last_index[i] of each line i (scope: the model's);
        under tensor parallelism this replica's block of them, [b, vocab padded / tp_degree]."""
        b, n, width = hidden.dims
        if n == 1:
            rows = reshape(hidden, (b, width))
        else:
            picked = []
            for i in range(b):
                index = reshape(dynamic_slice(last_index, [i], [1]), ())
                picked.append(dynamic_slice(hidden, [i, index, 0], [1, 1, width]))
            rows = reshape(concatenate(picked, 0), (b, width))
        return self.project(values, rows)

    def every_position(self, values: PieceValues, hidden: HloValue) -> HloValue:
        """f32 logits [b, n, vocab] of every position (speculative decoding's check of the
        draft tokens)."""
        b, n, width = hidden.dims
        logits = self.project(values, reshape(hidden, (b * n, width)))
        return reshape(logits, (b, n, logits.dims[1]))

    def project(self, values: PieceValues, rows: HloValue) -> HloValue:
        """Final norm and vocabulary projection of hidden rows [r, hidden] -> f32 logits [r, vocab]."""
        if self.norm is not None:
            rows = self.norm(values.scoped("final_norm", self.norm), rows)
        if self.projection is not None:
            rows = values.linear(rows, "project_out")
        logits = values.linear(rows, "lm_head", out_dtype="f32")
        if self.softcap is not None:
            logits = nn.soft_cap(logits, self.softcap)
        width = logits.dims[1]
        if width * values.lowering.tp_degree > self.vocab_size:
            # A zero padding row's logit 0 would beat negative real ones: it can never be chosen.
            columns = iota(logits.scribe, "s32", logits.dims, 1)
            ids = ew.add(columns, replica.block_start(logits.scribe, width))
            logits = ew.select(ew.compare(ids, self.vocab_size, "LT"), logits, float("-inf"))
        return logits
