"""What every piece of one decoder step sees besides its weights: where the new tokens go."""
from __future__ import annotations

from dataclasses import dataclass

from pyhlo.scribe import HloValue


@dataclass(frozen=True)
class Step:
    """`n_tokens` new tokens per batch line, written at cache slots slot .. slot + n_tokens - 1,
    attending to the first `n_attend` slots.

    Batch lines are left-padded: line i's real tokens start at slot pad[i], and its positions
    (rotary, learned, ALiBi) count from there: position = slot - pad[i].
    """

    positions: HloValue     # s32[batch, n_tokens]
    slot: HloValue          # s32[]
    pad: HloValue           # s32[batch]
    n_tokens: int
    n_attend: int

    @property
    def batch_size(self) -> int:
        return self.pad.dims[0]
