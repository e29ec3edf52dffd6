"""A module's cost for `pyhlo inspect`: XLA's estimate plus the work inside pyhlo's kernels.

XLA counts a custom call as unknown work, so a program whose products run in pyhlo's CPU
kernels looks almost free; runtime.kernel_costs counts those calls from their shapes and
the report shows the sum and both parts:

    cost = module_cost(module, backend.cost_analysis(module_bytes))
    cost.total("flops"), cost.xla_figure("flops"), cost.kernel_figure("flops")
    print(format_cost(cost))
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from pyhlo.schema import hlo_pb2
from runtime.kernel_costs import CUSTOM_CALL, ModuleKernelCosts, module_kernel_costs
from tools.text_format import format_table, human_bytes, human_count

MEASURES = ("flops", "transcendentals", "bytes accessed")
# XLA's HloCostAnalysis puts -1 ("unknown") in these for every custom call.
_MARKED_UNKNOWN = ("flops", "bytes accessed")
UPPER_BOUND_MARK = "*"


@dataclasses.dataclass(frozen=True)
class ModuleCost:
    """XLA's estimate of a module (as the backend gave it) and the work of its kernel calls."""

    xla: dict[str, float | str]
    kernels: ModuleKernelCosts = ModuleKernelCosts()
    custom_calls: int = 0  # every custom-call instruction, ours or not

    def xla_figure(self, measure: str) -> float:
        """XLA's figure for `measure`, less its -1 ("unknown") for each custom call."""
        if measure not in self.xla:
            return 0.0
        value = float(self.xla[measure])
        return value + self.custom_calls if measure in _MARKED_UNKNOWN else value

    def kernel_figure(self, measure: str) -> int:
        """What pyhlo's kernel calls add to `measure` (counted from their shapes)."""
        total = self.kernels.total
        return {"flops": total.flops, "transcendentals": total.transcendentals,
                "bytes accessed": total.bytes_accessed}[measure]

    def total(self, measure: str) -> float:
        return self.xla_figure(measure) + self.kernel_figure(measure)

    @property
    def analysed_by(self) -> str:
        """Whose XLA estimated the module ("XLA:cpu", or XLA:CPU's in place of a platform's), or ""."""
        source = self.xla.get("analysed by", "")
        return source if isinstance(source, str) else ""

    @property
    def upper_bound(self) -> bool:
        """Whether the kernels' part counts reads that depend on run-time values in full."""
        return self.kernels.total.upper_bound


def module_cost(module: hlo_pb2.HloModuleProto, xla: dict[str, float | str]) -> ModuleCost:
    """XLA's estimate `xla` of `module` with the work of the module's kernel calls beside it."""
    custom_calls = sum(i.opcode == CUSTOM_CALL for c in module.computations for i in c.instructions)
    return ModuleCost(xla, module_kernel_costs(module), custom_calls)


def _human(measure: str, units: bool = True) -> Callable[[float], str]:
    if measure == "bytes accessed":
        return human_bytes
    return lambda n: human_count(n, "FLOP" if measure == "flops" and units else "")


def _mark(cost: ModuleCost, measure: str) -> str:
    return UPPER_BOUND_MARK if cost.upper_bound and cost.kernel_figure(measure) else ""


def split_text(cost: ModuleCost, measure: str) -> str:
    """'350.9 K + 263.0 M*': XLA's part + the kernels' part, counts without units (* an upper bound)."""
    human = _human(measure, units=False)
    return f"{human(cost.xla_figure(measure))} + {human(cost.kernel_figure(measure))}{_mark(cost, measure)}"


def upper_bound_note(targets: tuple[str, ...] | list[str]) -> str:
    """The footnote of the figures marked *: which kernels' reads were counted whole, and why."""
    return (f"{UPPER_BOUND_MARK} an upper bound: {', '.join(targets)} counted over the whole KV cache; "
            "it reads only the filled slots, known at run time")


def notes(cost: ModuleCost) -> list[str]:
    """Lines that say where the figures come from."""
    lines = []
    if cost.analysed_by:
        lines.append(f"cost analysis: {cost.analysed_by}")
    if cost.kernels.calls:
        calls = ", ".join(f"{target} x {n}" for target, n in sorted(cost.kernels.calls.items()))
        lines.append(f"kernels (custom calls XLA cannot see into), counted from their shapes: {calls}")
    if cost.kernels.upper_bound_targets:
        lines.append(upper_bound_note(cost.kernels.upper_bound_targets))
    if cost.kernels.uncounted:
        calls = ", ".join(f"{target} x {n}" for target, n in sorted(cost.kernels.uncounted.items()))
        lines.append(f"custom calls whose work no figure counts: {calls}")
    return lines


def format_cost(cost: ModuleCost) -> str:
    """The cost section: each measure's total (and, with kernel calls, XLA's and the kernels' parts)."""
    split = bool(cost.kernels.calls)
    rows = []
    for measure in MEASURES:
        human, total = _human(measure), cost.total(measure)
        exact = f"{total:,.0f}" + (" B" if measure == "bytes accessed" else "")
        row = [measure, human(total), exact]
        if split:
            row += [human(cost.xla_figure(measure)),
                    human(cost.kernel_figure(measure)) + _mark(cost, measure)]
        rows.append(row)
    accessed = cost.total("bytes accessed")
    if accessed:
        rows.append(["flops per byte", f"{cost.total('flops') / accessed:.2f}", ""]
                    + (["", ""] if split else []))
    headers = ["measure", "value", "exact"] + (["XLA", "kernels"] if split else [])
    table = format_table(headers, rows, right=(1, 2, 3, 4))
    return "\n".join([table] + notes(cost))
