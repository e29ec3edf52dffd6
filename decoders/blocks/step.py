"""What every piece of one decoder step sees besides its weights: where the new tokens go."""
from __future__ import annotations

from dataclasses import dataclass

from pyhlo.ops.shape_ops import broadcast, reshape, slice_along
from pyhlo.scribe import HloValue


@dataclass(frozen=True)
class Step:
    """`n_tokens` new tokens per batch line, written at cache slots slot .. slot + n_tokens - 1,
    attending to the first `n_attend` slots.

    Batch lines are left-padded: line i's real tokens start at slot pad[i], and its positions
    (rotary, learned, ALiBi) count from there: position = slot - pad[i]. Under continuous
    batching `slot` holds one slot per line (s32[batch]): each line is its own sequence, at
    its own length. A program for some of the lines (a prompt prefilled into its own line while
    the others wait) names the cache line of each of its rows in `lines` (s32[rows]).
    """

    positions: HloValue     # s32[batch, n_tokens]
    slot: HloValue          # s32[], or s32[batch] per line
    pad: HloValue           # s32[batch]
    n_tokens: int
    n_attend: int
    lines: HloValue | None = None   # s32[rows]: each row's cache line; None: row i is line i

    @property
    def batch_size(self) -> int:
        return self.pad.dims[0]

    @property
    def per_line(self) -> bool:
        return len(self.slot.dims) == 1

    def line_slot(self, line: int) -> HloValue:
        """s32[]: where line `line` writes its first new token."""
        return reshape(slice_along(self.slot, 0, line, line + 1), ()) if self.per_line else self.slot

    def cache_line(self, row: int) -> HloValue | int:
        """The cache line that row `row` reads and writes."""
        return row if self.lines is None else reshape(slice_along(self.lines, 0, row, row + 1), ())

    def line_slots(self) -> HloValue:
        """s32[batch]: every line's first slot."""
        return self.slot if self.per_line else broadcast(self.slot, (self.batch_size,), [])
