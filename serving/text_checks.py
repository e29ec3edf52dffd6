"""Text a request carries must be Unicode that UTF-8 can hold: JSON's escapes can spell a lone
surrogate ("\\ud800"), which Python's JSON reader takes but no tokenizer can encode."""
from __future__ import annotations

from typing import Any


def invalid_text(value: Any, where: str = "") -> tuple[str, str] | None:
    """The first string in a request's fields that is not valid Unicode: where it lies (a
    dotted path, e.g. "messages.0.content") and what is wrong; None when every one is valid."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            return where, (f"{where or 'the request'}: not valid Unicode (a lone surrogate "
                           f"{value[error.start]!r} at character {error.start}); send UTF-8 text")
        return None
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = list(enumerate(value))
    else:
        return None
    for key, item in items:
        place = f"{where}.{key}" if where else str(key)
        found = (invalid_text(key, place) if isinstance(key, str) else None) or invalid_text(item, place)
        if found:
            return found
    return None
