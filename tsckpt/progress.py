"""The progress bar that long operations (verify, convert, diff) show on stderr, counting bytes."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

#: Above this many bytes a progress bar is shown by default when stderr is a terminal.
PROGRESS_BYTES = 1 << 30


def wanted(requested: bool | None, total: int) -> bool:
    """``requested`` if given, else whether ``total`` bytes is large enough to show a bar in a terminal."""
    return requested if requested is not None else (total >= PROGRESS_BYTES and sys.stderr.isatty())


@contextlib.contextmanager
def progress_bar(enabled: bool, total: int, description: str, *,
                 transient: bool = False) -> Iterator[Callable[[int], None]]:
    """A rich progress bar on stderr; yields ``advance(nbytes)``, a no-op when disabled."""
    if not enabled:
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=transient) as bar:
        task = bar.add_task(description, total=max(total, 1))
        yield lambda n: bar.advance(task, n)
