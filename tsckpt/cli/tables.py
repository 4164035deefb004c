"""How the commands print tables: fitted to a terminal, at their natural width when piped."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def print_wide(table: Table, console: Console | None = None) -> None:
    """In a terminal the table fits the window; piped, it takes its natural width, so no cell is cut."""
    console = console or Console()
    if console.is_terminal:
        console.print(table, highlight=False)
    else:
        width = console.measure(table, options=console.options.update_width(1 << 16)).maximum
        Console(width=max(width, 20), file=console.file).print(table, highlight=False)
