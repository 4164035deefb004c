"""Counted nouns and sizes in messages: "1 rank", "4 ranks", "1.1 GiB". Torch-free."""

from __future__ import annotations


def count(n: int, noun: str) -> str:
    """``n`` and ``noun``, with an "s" unless ``n`` is 1."""
    return f"{n} {noun if n == 1 else noun + 's'}"


def human_bytes(n: int | None) -> str:
    """``n`` bytes in binary units (``"512 B"``, ``"1.1 GiB"``); ``"?"`` for None."""
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"
