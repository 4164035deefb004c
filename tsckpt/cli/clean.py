"""``tsckpt clean PATH``: remove what saves into PATH that did not finish left behind.

``info`` and ``verify`` report the same leftovers with :func:`leftover_line`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from ..wording import human_bytes
from .base import app, flag

if TYPE_CHECKING:
    from ..commit.target import Leftover


def leftover_line(path: str, items: list[Leftover] | None = None) -> str | None:
    """One line about leftovers of unfinished saves into ``path`` (``items``, or looked up), or None if none."""
    from ..commit.protocol import leftovers

    items = leftovers(path) if items is None else items
    dead = [i for i in items if i.live is False]
    unknown = [i for i in items if i.live is None]
    live = [i for i in items if i.live]
    parts = []
    if dead:
        parts.append(f"{len(dead)} leftover(s) ({human_bytes(sum(i.nbytes for i in dead))}) from aborted saves: "
                     f"remove with `tsckpt clean {path}`")
    if unknown:
        parts.append(f"{len(unknown)} leftover(s) ({human_bytes(sum(i.nbytes for i in unknown))}) of saves that may "
                     f"still be running ({unknown[0].what}): if none is, remove with `tsckpt clean --force {path}`")
    if live:
        parts.append(f"{len(live)} save(s) in progress ({human_bytes(sum(i.nbytes for i in live))} written so far)")
    return "; ".join(parts) or None


@app.command()
def clean(
    path: str = typer.Argument(..., help="checkpoint directory or URL"),
    force: bool = flag(False, "--force", help="also remove leftovers that cannot be told apart from a running "
                       "save (claims on object stores, staging on filesystems without locks)"),
) -> None:
    """Remove leftovers of saves into PATH that did not finish; a committed checkpoint is never touched."""
    from ..commit.protocol import clean as run_clean

    removed = run_clean(path, force=force)
    remaining = leftover_line(path)
    for item in removed:
        print(f"removed {item.path}: {item.what}, {human_bytes(item.nbytes)}")
    print(f"{len(removed)} leftover(s) removed ({human_bytes(sum(i.nbytes for i in removed))})")
    if remaining:
        print(f"left: {remaining}")
