"""Numbers and tables as `pyhlo inspect` prints them: 1.5 KiB, 56.6 MFLOP, aligned columns."""
from __future__ import annotations

from typing import Any, Sequence


def _scaled(n: float, base: int, prefixes: Sequence[str]) -> tuple[float, str]:
    i = 0
    while abs(n) >= base and i < len(prefixes) - 1:
        n /= base
        i += 1
    return n, prefixes[i]


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units)."""
    value, unit = _scaled(n, 1024, ("B", "KiB", "MiB", "GiB", "TiB"))
    return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"


def human_count(n: float, unit: str = "") -> str:
    """56625408 -> '56.6 M' (decimal units), with `unit` appended: human_count(n, 'FLOP') -> '56.6 MFLOP'."""
    value, prefix = _scaled(n, 1000, ("", "K", "M", "G", "T", "P"))
    number = f"{value:.0f}" if not prefix else f"{value:.1f}"
    return f"{number} {prefix}{unit}".rstrip()


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> str:
    """Aligned text columns; columns whose index is in `right` are right-aligned."""
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(row, widths))).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])
