"""Typed keys of the programs a model is built from; each knows how to build itself.

    ProgramSet.get(Block(n_tokens=1, n_attend=256))    # compiled on first use
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from decoders.programs.builder import Program, ProgramBuilder


@dataclass(frozen=True)
class Embed:
    """Token ids [b, n] -> hidden states (b: every line, or `rows` of them)."""

    n_tokens: int
    rows: int | None = None

    def build(self, builder: ProgramBuilder) -> Program:
        return builder.embed(self.n_tokens, self.rows)


@dataclass(frozen=True)
class Block:
    """One decoder layer over n_tokens per line, attending to n_attend cache slots; every
    layer of kind `kind` (Decoder.kinds) runs it with its own weights and caches. With `rows`,
    continuous batching's program for that many lines, each row naming its cache line."""

    n_tokens: int
    n_attend: int
    rows: int | None = None
    kind: int = 0

    def build(self, builder: ProgramBuilder) -> Program:
        return builder.block(self.n_tokens, self.n_attend, self.rows, self.kind)


@dataclass(frozen=True)
class LMHead:
    """Final norm and vocabulary projection of one position per line -> f32 logits (under
    tensor parallelism, each replica's block of the vocabulary)."""

    n_tokens: int
    rows: int | None = None

    def build(self, builder: ProgramBuilder) -> Program:
        return builder.lm_head(self.n_tokens, self.rows)


@dataclass(frozen=True)
class LMHeadAll:
    """Final norm and vocabulary projection of every one of n_tokens positions -> f32 logits
    [b, n_tokens, vocab] (speculative decoding; a prompt chunk's logprobs, for `rows` lines)."""

    n_tokens: int
    rows: int | None = None

    def build(self, builder: ProgramBuilder) -> Program:
        return builder.lm_head_all(self.n_tokens, self.rows)


@dataclass(frozen=True)
class CopyLine:
    """Every layer's caches, the keys and values of `slots` slots of one line from a given slot
    copied into another's (continuous batching)."""

    slots: int

    def build(self, builder: ProgramBuilder) -> Program:
        return builder.copy_line(self.slots)


@dataclass(frozen=True)
class ModelStep:
    """The whole model unrolled: token ids -> logits, every layer's caches updated; for every
    line, or for `rows` of them (continuous batching's decode_lines())."""

    n_tokens: int
    n_attend: int
    rows: int | None = None

    def build(self, builder: ProgramBuilder) -> Program:
        return builder.model_step(self.n_tokens, self.n_attend, self.rows)


@dataclass(frozen=True)
class Greedy:
    """Logits -> the most likely token of every line."""

    def build(self, builder: ProgramBuilder) -> Program:
        return builder.greedy()


@dataclass(frozen=True)
class Sampler:
    """Logits -> a token drawn with top-k (at most k_max), top-p and temperature per line."""

    k_max: int

    def build(self, builder: ProgramBuilder) -> Program:
        return builder.sampler(self.k_max)


ProgramKey = Embed | Block | LMHead | ModelStep | Greedy | Sampler
