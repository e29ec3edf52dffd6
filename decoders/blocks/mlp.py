"""MLP piece: gated (Llama: down(act(gate) * up)) or plain (GPT-NeoX, Bloom: down(act(up))); a
gated MLP's gate and up read from two projections (Llama) or one fused [gate | up] (Phi-3).

A mixture-of-experts MLP is another piece with the same call: x in, x out.
"""
from __future__ import annotations

from dataclasses import dataclass

from decoders.blocks.params import Kind, Param, Shard, Source, transposed
from decoders.blocks.values import PieceValues
from pyhlo.ops import elementwise as ew
from pyhlo.ops import nn
from pyhlo.ops.shape_ops import slice_along
from pyhlo.scribe import HloValue


@dataclass(frozen=True)
class MLP:
    """Checkpoint prefixes of the linears ({i}: layer), e.g. "model.layers.{i}.mlp.up_proj";
    `gate` None makes a plain MLP, unless `gate_up_fused`: then `up` names one projection whose
    first half of rows is the gate and second half the up (Phi-3's gate_up_proj)."""

    up: str
    down: str
    hidden: int
    intermediate: int
    gate: str | None = None
    activation: str = "silu"
    bias: bool = False
    # Linear weights stored [in, out] (GPT-2's Conv1D), transposed on reading.
    stored_in_out: bool = False
    gate_up_fused: bool = False

    def __post_init__(self) -> None:
        nn.activation_fn(self.activation)   # an unknown name fails here, with the valid ones
        if self.stored_in_out and self.gated:
            # gate|up is read by concatenating along axis 0, which is `in` for [in, out] tensors.
            raise ValueError("a gated MLP with weights stored [in, out] is not supported")
        if self.gate_up_fused and self.gate is not None:
            raise ValueError("a fused gate_up projection is named by `up` alone; give no `gate`")

    @property
    def gated(self) -> bool:
        return self.gate is not None or self.gate_up_fused

    def _source(self, name: str, suffix: str) -> Source:
        return Source((f"{name}.{suffix}",),
                      (transposed(),) if self.stored_in_out and suffix == "weight" else ())

    def params(self, scope: str) -> list[Param]:
        hidden, intermediate = self.hidden, self.intermediate
        suffixes = ("weight", "bias") if self.bias else ("weight",)
        declared = []
        for suffix in suffixes:
            shape = (intermediate, hidden) if suffix == "weight" else (intermediate,)
            kind = Kind.LINEAR if suffix == "weight" else Kind.VECTOR
            if self.gated:
                names = ((f"{self.up}.{suffix}",) if self.gate_up_fused
                         else (f"{self.gate}.{suffix}", f"{self.up}.{suffix}"))
                declared.append(Param(f"{scope}.gate_up.{suffix}", kind, (2 * intermediate, *shape[1:]),
                                      Shard.COLUMN, Source(names), segments=(intermediate, intermediate)))
            else:
                declared.append(Param(f"{scope}.up.{suffix}", kind, shape, Shard.COLUMN,
                                      self._source(self.up, suffix)))
        declared.append(Param(f"{scope}.down.weight", Kind.LINEAR, (hidden, intermediate), Shard.ROW,
                              self._source(self.down, "weight")))
        if self.bias:
            # Added once, after the row-parallel product is summed over devices.
            declared.append(Param(f"{scope}.down.bias", Kind.VECTOR, (hidden,), Shard.REPLICATED,
                                  Source((f"{self.down}.bias",))))
        return declared

    def __call__(self, values: PieceValues, x: HloValue) -> HloValue:
        act = nn.activation_fn(self.activation)
        if not self.gated:
            inner = act(values.linear(x, "up"))
        else:
            gate_up = values.linear(x, "gate_up")
            width = gate_up.dims[-1] // 2
            last = len(gate_up.dims) - 1
            inner = ew.multiply(act(slice_along(gate_up, last, 0, width)),
                                slice_along(gate_up, last, width, 2 * width))
        return values.linear(inner, "down")
