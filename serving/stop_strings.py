"""Stop strings over generated text: where one begins, and how much of a text's end may still
become one (to hold back from a stream until it is known). `pyhlo generate --stop` and the
OpenAI API's `stop` both cut here."""
from __future__ import annotations


def cut_at_stop(text: str, stops: list[str]) -> int | None:
    """Where the first stop string begins in `text` (None: nowhere)."""
    found = [text.index(s) for s in stops if s in text]
    return min(found) if found else None


def held_back(text: str, stops: list[str]) -> int:
    """How many characters at the end of `text` may begin a stop string."""
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
