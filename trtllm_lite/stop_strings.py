"""Stop strings over incrementally decoded text.

A stop string may start or end inside a token and span several tokens, so it is searched
in the text, not in token ids. While streaming, a tail of the text that could still grow
into a stop string is held back, and released once it cannot (or at the finish).
"""
from __future__ import annotations


def find_stop(text: str, new_chars: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that the last ``new_chars`` characters completed.

    Returns ``(index of its first character in text, the stop string)`` or None. Only
    occurrences ending inside the new characters are looked for (earlier ones would have
    stopped an earlier step).
    """
    best = None
    for stop in stops:
        start = max(0, len(text) - new_chars - len(stop) + 1)
        i = text.find(stop, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    return best


def held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of ``text`` that are a proper prefix of some stop string."""
    hold = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:n]):
                hold = n
                break
    return hold
