"""Norm piece: RMS norm (Llama) or layer norm (GPT-NeoX, Bloom, GPT-2), with or without a bias."""
from __future__ import annotations

from dataclasses import dataclass

from decoders.blocks.params import Kind, Param, Shard, Source
from decoders.blocks.values import PieceValues
from pyhlo.ops import nn
from pyhlo.scribe import HloValue


@dataclass(frozen=True)
class Norm:
    """`checkpoint` is the tensor prefix ({i}: layer), e.g. "model.layers.{i}.input_layernorm"."""

    checkpoint: str
    width: int
    kind: str = "rms"          # "rms" | "layer"
    bias: bool = False
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.kind not in ("rms", "layer"):
            raise ValueError(f"Norm.kind must be 'rms' or 'layer', got {self.kind!r}")
        if self.kind == "rms" and self.bias:
            raise ValueError("an RMS norm has no bias")

    def params(self, scope: str) -> list[Param]:
        width = self.width
        declared = [Param(f"{scope}.weight", Kind.VECTOR, (width,), Shard.REPLICATED,
                          Source((f"{self.checkpoint}.weight",)))]
        if self.bias:
            declared.append(Param(f"{scope}.bias", Kind.VECTOR, (width,), Shard.REPLICATED,
                                  Source((f"{self.checkpoint}.bias",))))
        return declared

    def __call__(self, values: PieceValues, x: HloValue) -> HloValue:
        if self.kind == "rms":
            return nn.rms_norm(x, values["weight"], self.eps)
        return nn.layer_norm(x, values["weight"], values.get("bias"), self.eps)
