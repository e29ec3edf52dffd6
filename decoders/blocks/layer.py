"""Decoder layer: norms, attention and MLP wired sequentially (Llama, Bloom; Gemma with a norm
on each branch's output too), in parallel (GPT-NeoX, GPT-J) or sequentially with the norms
after the residual sums (OPT-350m); and `Decoder`, the whole model as pieces, whose layers may
be of a few kinds that differ in their attention (Gemma's sliding-window and global layers)."""
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
    norm1 is `input_norm`, norm2 `post_norm`. A sequential layer may also norm each branch's
    output before it joins the residual (Gemma): h += attn_out_norm(attn(norm1(h))),
    h += mlp_out_norm(mlp(norm2(h)))."""

    input_norm: Norm
    attention: Attention
    mlp: MLP | MoE      # a mixture of experts has the MLP's call
    post_norm: Norm | None
    residual: str = "sequential"
    attention_out_norm: Norm | None = None
    mlp_out_norm: Norm | None = None

    def __post_init__(self) -> None:
        if self.residual not in RESIDUALS:
            raise ValueError(f"residual must be one of {', '.join(RESIDUALS)}, got {self.residual!r}")
        if self.post_norm is None and self.residual != "parallel":
            raise ValueError(f"a {self.residual} layer needs a post-attention norm")
        if (self.attention_out_norm or self.mlp_out_norm) and self.residual != "sequential":
            raise ValueError("norms on the attention's and the MLP's outputs need a sequential residual")

    def params(self) -> list[Param]:
        """Every parameter of one layer, in program order; names are the same in every layer."""
        declared = self.input_norm.params("input_norm") + self.attention.params("attn")
        if self.attention_out_norm is not None:
            declared += self.attention_out_norm.params("attn_out_norm")
        if self.post_norm is not None:
            declared += self.post_norm.params("post_norm")
        declared += self.mlp.params("mlp")
        if self.mlp_out_norm is not None:
            declared += self.mlp_out_norm.params("mlp_out_norm")
        return declared

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
        if self.attention_out_norm is not None:
            out_norm = layer.scoped("attn_out_norm", self.attention_out_norm)
            attended = self.attention_out_norm(out_norm, attended)
        hidden = ew.add(hidden, attended)
        post_norm = layer.scoped("post_norm", self.post_norm)
        if self.residual == "post":
            hidden = self.input_norm(input_norm, hidden)
            return self.post_norm(post_norm, ew.add(hidden, self.mlp(mlp, hidden))), cache_k, cache_v
        out = self.mlp(mlp, self.post_norm(post_norm, hidden))
        if self.mlp_out_norm is not None:
            out = self.mlp_out_norm(layer.scoped("mlp_out_norm", self.mlp_out_norm), out)
        return ew.add(hidden, out), cache_k, cache_v


@dataclass(frozen=True)
class Decoder:
    """A whole decoder LLM as pieces: what a family description produces from a config.

    Every layer is `layer`, or, where `layer_kinds` is given, layer i is kinds[layer_kinds[i]]
    (kinds: `layer`, then `other_kinds`): layers that differ in their attention only (window,
    rotary frequencies), with the same parameters and caches. Each kind has its own block
    program; Decoder.of_layers() sorts a list of layers into kinds."""

    embedding: Embedding
    layer: DecoderLayer
    head: Head
    n_layers: int
    other_kinds: tuple[DecoderLayer, ...] = ()
    layer_kinds: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.layer_kinds and (len(self.layer_kinds) != self.n_layers
                                 or not set(self.layer_kinds) <= set(range(len(self.kinds)))):
            raise ValueError(f"layer_kinds must name one of the {len(self.kinds)} kinds for each of the "
                             f"{self.n_layers} layers, got {self.layer_kinds}")
        def declared(kind: DecoderLayer) -> list[tuple]:
            return [(p.name, p.shape, p.shard, p.source.names) for p in kind.params()]

        if any(declared(kind) != declared(self.layer) for kind in self.other_kinds):
            raise ValueError("the kinds of layer of one decoder must declare the same parameters")

    @classmethod
    def of_layers(cls, embedding: Embedding, layers: list[DecoderLayer], head: Head) -> Decoder:
        """A decoder of these layers, in order; each distinct layer becomes a kind."""
        kinds = list(dict.fromkeys(layers))
        if len(kinds) == 1:
            return cls(embedding, kinds[0], head, len(layers))
        return cls(embedding, kinds[0], head, len(layers), tuple(kinds[1:]),
                   tuple(kinds.index(layer) for layer in layers))

    @property
    def kinds(self) -> tuple[DecoderLayer, ...]:
        """Every kind of layer, kind 0 first."""
        return (self.layer, *self.other_kinds)

    def kind_of(self, layer: int) -> int:
        return self.layer_kinds[layer] if self.layer_kinds else 0

    @property
    def tied(self) -> bool:
        return self.head.weight is None

    def for_context(self, n_positions: int) -> Decoder:
        """The pieces of a model of `n_positions` positions (LongRoPE's frequencies: Rotary.for_context),
        for every kind of layer."""
        return self._each_attention(lambda attention: attention.for_context(n_positions))

    def _each_attention(self, change) -> Decoder:
        layer, *others = (replace(kind, attention=change(kind.attention)) for kind in self.kinds)
        return replace(self, layer=layer, other_kinds=tuple(others))

    def sharded(self, tp_degree: int, kv_sharding: KVSharding = KVSharding.HEADS) -> Decoder:
        """The pieces as one device of `tp_degree` runs them (its share of the attention heads,
        keys and values shared out by `kv_sharding`); parameter declarations stay the whole
        model's."""
        return self._each_attention(lambda attention: attention.sharded(tp_degree, kv_sharding))

    def with_kv_quant(self) -> Decoder:
        """The same pieces over KV caches of packed int8 rows (Attention.kv_quant)."""
        return self._each_attention(lambda attention: replace(attention, kv_quant=True))

    def with_cache_type(self, dtype: str) -> Decoder:
        """The same pieces over KV caches of `dtype` (Attention.cache_type)."""
        return self._each_attention(lambda attention: replace(attention, cache_type=dtype))

    def token_table(self, one_table: bool) -> str:
        return HEAD_WEIGHT if one_table else TOKENS
