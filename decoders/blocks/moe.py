"""Mixture-of-experts MLP piece (Mixtral, Qwen3-MoE): a router picks `top_k` experts per token,
each a gated MLP, and their outputs are summed with the router's probabilities, renormalised
over the chosen experts (Mixtral; Qwen3-MoE's norm_topk_prob) or as they are.

The call is the MLP's (x in, x out), so `DecoderLayer` takes either. Each expert declares its
weights as an `MLP` does, under "experts.E" (e.g. `mlp.experts.3.gate_up.weight`), so every
lowering, tensor-parallel sharding and the CPU matrix-vector kernel handle them unchanged.

Cost: every expert is computed for every token and the ones not chosen are weighted by 0,
so a step does n_experts / top_k times the products of a sparse dispatch (4x for Mixtral's
8 experts, top 2) and, at decode, reads every expert's weights. Exact, and without
data-dependent shapes; a gather of the chosen experts' weights would avoid it.
"""
from __future__ import annotations

from dataclasses import dataclass

from decoders.blocks.mlp import MLP
from decoders.blocks.params import Kind, Param, Shard, Source
from decoders.blocks.values import PieceValues
from pyhlo.ops import elementwise as ew
from pyhlo.ops import nn
from pyhlo.ops.reductions import reduce_sum
from pyhlo.ops.shape_ops import broadcast, iota, reshape, slice_along
from pyhlo.scribe import HloValue


@dataclass(frozen=True)
class MoE:
    """`router` is the checkpoint prefix ({i}: layer) of the router's linear [n_experts, hidden],
    e.g. "model.layers.{i}.block_sparse_moe.gate"; `experts` the gated MLPs, in index order."""

    router: str
    experts: tuple[MLP, ...]
    top_k: int
    # The kept probabilities divided by their sum (Mixtral), or used as the softmax gave them.
    renormalise: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= len(self.experts):
            raise ValueError(f"top_k must be in 1..{len(self.experts)} (the number of experts), got "
                             f"{self.top_k}")
        if len({(e.hidden, e.intermediate) for e in self.experts}) != 1:
            raise ValueError("every expert must have the same hidden and intermediate sizes")

    @property
    def hidden(self) -> int:
        return self.experts[0].hidden

    def params(self, scope: str) -> list[Param]:
        # Every device routes every token: the router is small and replicated.
        declared = [Param(f"{scope}.router.weight", Kind.LINEAR, (len(self.experts), self.hidden),
                          Shard.REPLICATED, Source((f"{self.router}.weight",)))]
        for e, expert in enumerate(self.experts):
            declared += expert.params(f"{scope}.experts.{e}")
        return declared

    def routing(self, logits: HloValue) -> HloValue:
        """f32 [..., n_experts] weights of router logits: softmax over every expert, the top_k
        probabilities kept (by value, as torch.topk; exact ties to the lower index, where
        torch leaves the order unspecified) and, with `renormalise`, scaled to sum to 1; the
        others 0."""
        probs = nn.softmax(ew.convert(logits, "f32"))
        dims, last = probs.dims, len(probs.dims) - 1
        pairs = (*dims, dims[-1])                       # [..., e, j]: expert e against expert j
        mine = broadcast(probs, pairs, list(range(last + 1)))
        other = broadcast(probs, pairs, [*range(last), last + 1])
        lower = ew.compare(iota(probs.scribe, "s32", pairs, last + 1), iota(probs.scribe, "s32", pairs, last),
                           "LT")
        tie = probs.scribe.pred[pairs].And(ew.compare(other, mine, "EQ"), lower)
        ahead = probs.scribe.pred[pairs].Or(ew.compare(other, mine, "GT"), tie)
        # Expert e's rank: the experts ahead of it (more probable, or as probable with a lower index).
        rank = reduce_sum(ew.convert(ahead, "s32"), last + 1)
        kept = ew.select(ew.compare(rank, self.top_k, "LT"), probs, 0.0)
        if not self.renormalise:
            return kept
        return ew.divide(kept, nn.expand(reduce_sum(kept, last), dims, last))

    def __call__(self, values: PieceValues, x: HloValue) -> HloValue:
        weights = self.routing(values.linear(x, "router"))    # in x's type, as HF
        last = len(x.dims) - 1
        out = None
        for e, expert in enumerate(self.experts):
            y = ew.convert(expert(values.scoped(f"experts.{e}", expert), x), "f32")
            weight = reshape(slice_along(weights, last, e, e + 1), weights.dims[:-1])
            # As HF: each weighted expert output rounded to x's type, then summed in it.
            term = ew.convert(ew.multiply(y, nn.expand(weight, y.dims, last)), x.dtype)
            out = term if out is None else ew.add(out, term)
        return out
