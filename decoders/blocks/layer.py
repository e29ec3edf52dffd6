"""Decoder layer: norms, attention and MLP wired sequentially (Llama, Bloom), in parallel
(GPT-NeoX, GPT-J) or sequentially with the norms after the residual sums (OPT-350m); and
`Decoder`, the whole model as pieces."""
from __future__ import annotations

from dataclasses import dataclass, replace

from decoders.blocks.attention import Attention
from decoders.blocks.embedding import HEAD_WEIGHT, TOKENS, Embedding, Head
from decoders.blocks.mlp import MLP
from decoders.blocks.moe import MoE
from decoders.blocks.norm import Norm
from decoders.blocks.params import Param
from decoders.blocks.step import Step
from decoders.blocks.values import PieceValues
from decoders.parallel.kv_sharding import KVSharding
from pyhlo.ops import elementwise as ew
from pyhlo.scribe import HloValue

RESIDUALS = ("sequential", "parallel", "post")


@dataclass(frozen=True)
class DecoderLayer:
    """sequential: h += attn(norm1(h)); h += mlp(norm2(h)).
    parallel:   h += attn(norm1(h)) + mlp(norm2(h)), or mlp(norm1(h)) when post_norm is None.
    post:       h = norm1(h + attn(h)); h = norm2(h + mlp(h)).
    norm1 is `input_norm`, norm2 `post_norm`."""

    input_norm: Norm
    attention: Attention
    mlp: MLP | MoE      # a mixture of experts has the MLP's call
    post_norm: Norm | None
    residual: str = "sequential"

    def __post_init__(self) -> None:
        if self.residual not in RESIDUALS:
            raise ValueError(f"residual must be one of {', '.join(RESIDUALS)}, got {self.residual!r}")
        if self.post_norm is None and self.residual != "parallel":
            raise ValueError(f"a {self.residual} layer needs a post-attention norm")

    def params(self) -> list[Param]:
        """Every parameter of one layer, in program order; names are the same in every layer."""
        declared = self.input_norm.params("input_norm") + self.attention.params("attn")
        if self.post_norm is not None:
            declared += self.post_norm.params("post_norm")
        return declared + self.mlp.params("mlp")

    def __call__(self, values: dict[str, HloValue], lowering, hidden: HloValue, step: Step,
                 cache_k: HloValue, cache_v: HloValue) -> tuple[HloValue, HloValue, HloValue]:
        layer = PieceValues(values, lowering, "", [])
        input_norm = layer.scoped("input_norm", self.input_norm)
        x = hidden if self.residual == "post" else self.input_norm(input_norm, hidden)
        attended, cache_k, cache_v = self.attention(layer.scoped("attn", self.attention), x, step, cache_k,
                                                    cache_v)
        mlp = layer.scoped("mlp", self.mlp)
        if self.residual == "parallel":
            second = (x if self.post_norm is None
                      else self.post_norm(layer.scoped("post_norm", self.post_norm), hidden))
            return ew.add(ew.add(hidden, attended), self.mlp(mlp, second)), cache_k, cache_v
        hidden = ew.add(hidden, attended)
        post_norm = layer.scoped("post_norm", self.post_norm)
        if self.residual == "post":
            hidden = self.input_norm(input_norm, hidden)
            return self.post_norm(post_norm, ew.add(hidden, self.mlp(mlp, hidden))), cache_k, cache_v
        x = self.post_norm(post_norm, hidden)
        return ew.add(hidden, self.mlp(mlp, x)), cache_k, cache_v


@dataclass(frozen=True)
class Decoder:
    """A whole decoder LLM as pieces: what a family description produces from a config."""

    embedding: Embedding
    layer: DecoderLayer
    head: Head
    n_layers: int

    @property
    def tied(self) -> bool:
        return self.head.weight is None

    def for_context(self, n_positions: int) -> Decoder:
        """The pieces of a model of `n_positions` positions (LongRoPE's frequencies: Rotary.for_context)."""
        attention = self.layer.attention.for_context(n_positions)
        return replace(self, layer=replace(self.layer, attention=attention))

    def sharded(self, tp_degree: int, kv_sharding: KVSharding = KVSharding.HEADS) -> Decoder:
        """The pieces as one device of `tp_degree` runs them (its share of the attention heads,
        keys and values shared out by `kv_sharding`); parameter declarations stay the whole
        model's."""
        attention = self.layer.attention.sharded(tp_degree, kv_sharding)
        layer = replace(self.layer, attention=attention)
        return replace(self, layer=layer)

    def with_kv_quant(self) -> Decoder:
        """The same pieces over KV caches of packed int8 rows (Attention.kv_quant)."""
        return replace(self,
                       layer=replace(self.layer, attention=replace(self.layer.attention, kv_quant=True)))

    def token_table(self, one_table: bool) -> str:
        return HEAD_WEIGHT if one_table else TOKENS
