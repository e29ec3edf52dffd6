"""Norm piece: RMS norm (Llama) or layer norm (GPT-NeoX, Bloom, GPT-2), with or without a bias;
an RMS norm scaling by (1 + weight) as Gemma's do (`weight_offset`)."""
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
    # Added to the stored weight before it scales (RMS norms only): Gemma stores weight - 1 and
    # scales by (1 + weight), 1.0 here; 0.0 for the plain weight of Llama, Qwen3, ...
    weight_offset: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("rms", "layer"):
            raise ValueError(f"Norm.kind must be 'rms' or 'layer', got {self.kind!r}")
        if self.kind == "rms" and self.bias:
            raise ValueError("an RMS norm has no bias")
        if self.kind == "layer" and self.weight_offset:
            raise ValueError("a weight_offset is for RMS norms (Gemma's); a layer norm has none")

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
            return nn.rms_norm(x, values["weight"], self.eps, self.weight_offset)
        return nn.layer_norm(x, values["weight"], values.get("bias"), self.eps)
