"""The values a piece reads while its program is written: its parameters and the lowering."""
from __future__ import annotations

from typing import Mapping

from decoders.blocks.params import Param
from pyhlo.scribe import HloValue


class PieceValues:
    """One piece's declared parameters, reached by the name after the piece's scope.

        values = PieceValues(program_values, lowering, "attn", attention.params("attn"))
        values["out.weight"]                    # program parameter "attn.out.weight"
        values.linear(x, "out")                 # x @ attn.out.weight (+ attn.out.bias if declared)
    """

    def __init__(self, values: Mapping[str, HloValue], lowering, scope: str, params: list[Param]):
        self.lowering = lowering
        self.scope = scope
        self._values = values
        self._params = {p.name: p for p in params}

    def _key(self, name: str) -> str:
        return f"{self.scope}.{name}" if self.scope else name

    def scoped(self, child: str, piece) -> PieceValues:
        """The values of `piece` (anything with params(scope)) under scope `child` of this one,
        e.g. the norm inside the embedding ("embed.norm")."""
        scope = self._key(child)
        return PieceValues(self._values, self.lowering, scope, piece.params(scope))

    def __getitem__(self, name: str) -> HloValue:
        return self._values[self._key(name)]

    def get(self, name: str) -> HloValue | None:
        key = self._key(name)
        return self._values[key] if key in self._params else None

    def linear(self, x: HloValue, name: str, out_dtype: str | None = None) -> HloValue:
        """x @ NAME.weight, plus NAME.bias when the piece declared one, as the lowering does it
        (a quantized weight with its scales, NAME.weight.scale, and minimums, NAME.weight.min,
        where its form has them)."""
        param = self._params[self._key(f"{name}.weight")]
        weight = self[f"{name}.weight"]
        return self.lowering.linear(x, weight, param, bias=self.get(f"{name}.bias"), out_dtype=out_dtype,
                                    scale=self._part(f"{name}.weight.scale"),
                                    mins=self._part(f"{name}.weight.min"))

    def _part(self, name: str) -> HloValue | None:
        """An array of a quantized weight (declared by the program, not by the piece), if any."""
        key = self._key(name)
        return self._values[key] if key in self._values else None
