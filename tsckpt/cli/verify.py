"""``tsckpt verify PATH``: read every chunk and check it; exit 1 with a per-tensor report on damage."""

from __future__ import annotations

import json

import typer

from . import app, flag
from .exits import FOUND
from .messages import failed


@app.command()
def verify(
    path: str = typer.Argument(..., help="checkpoint directory or file:// URL"),
    progress: bool = flag(None, "--progress/--no-progress",
                                  help="progress bar (default: on for large checkpoints in a terminal)"),
    as_json: bool = flag(False, "--json", help="print the full report as JSON (keys: see tsckpt.cli.summary)"),
) -> None:
    """Check that every tensor's chunks exist, decode and pass their crc32c checksums."""
    from rich.console import Console

    from ..errors import TsckptError
    from ..commit.publication import leftovers
    from ..read.verify import verify as run_verify
    from .summary import verification
    from .clean import leftover_line

    out = Console()
    try:
        report = run_verify(path, progress=progress)
        items = leftovers(path)
    except TsckptError as e:
        raise failed(e, "FAILED") from None
    if as_json:
        print(json.dumps(verification(report) | {"leftovers": [i.to_dict() for i in items]}, indent=1))
    else:
        for entry in report.failed:
            out.print(f"[bold red]{entry.key}[/] ({entry.path}): {len(entry.problems)} problem(s)", highlight=False)
            for problem in entry.problems:
                out.print(f"  - {problem}", markup=False, highlight=False)
        status = "[bold green]OK[/]" if report.ok else f"[bold red]FAILED[/] ({len(report.failed)} damaged)"
        out.print(f"{status} {report.location}: {len(report.entries)} arrays, {report.chunks} chunks, "
                  f"{report.nbytes} bytes checked", highlight=False)
        left = leftover_line(path, items)
        if left:
            out.print(f"[bold yellow]note[/] {left}", highlight=False)
    if not report.ok:
        raise typer.Exit(FOUND)
