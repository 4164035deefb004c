"""Counted nouns in messages: "1 rank", "4 ranks". Torch-free."""

from __future__ import annotations


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun``, in the plural (``noun + "s"`` unless given) unless ``n`` is 1."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
