"""``tsckpt latest ROOT`` and ``tsckpt prune ROOT --keep K``: chores on a directory of step checkpoints."""

from __future__ import annotations

import json
import sys

import typer

from . import app
from .exits import FOUND


@app.command("latest")
def latest_cmd(
    root: str = typer.Argument(..., help="directory or URL holding step checkpoints (ckpt/step_1000, ...)"),
    as_json: bool = typer.Option(False, "--json", help="print every step entry with its state, and the latest, "
                                                       "as JSON"),
) -> None:
    """Print the newest committed checkpoint under ROOT; exit 1 when there is none.

    The newest is the entry with the largest integer in its name; saves that
    have not committed (running or dead) and entries that are not tsckpt
    checkpoints are skipped.
    """
    from ..steps import COMMITTED, latest, scan

    if as_json:
        entries = scan(root)
        committed = [e for e in entries if e.state == COMMITTED]
        print(json.dumps({"root": root, "latest": committed[-1].url if committed else None,
                          "entries": [e.to_dict() for e in entries]}, indent=1))
        found = bool(committed)
    else:
        path = latest(root)
        found = path is not None
        if found:
            print(path)
        else:
            print(f"no committed checkpoint under {root}", file=sys.stderr)
    if not found:
        raise typer.Exit(FOUND)


@app.command("prune")
def prune_cmd(
    root: str = typer.Argument(..., help="directory or URL holding step checkpoints"),
    keep: int = typer.Option(..., "--keep", "-k", min=1, help="committed checkpoints to keep, newest first"),
    dry_run: bool = typer.Option(False, "--dry-run", "-n", help="only print what would be removed"),
    remove_incomplete: bool = typer.Option(
        False, "--remove-incomplete",
        help="also remove saves that never committed and are older than the newest committed checkpoint "
             "(dead saves); only when no save to an older step can be running"),
) -> None:
    """Remove all but the KEEP newest committed checkpoints under ROOT.

    The newest committed checkpoint is always kept, saves newer than it
    (being written) are never touched, nor is anything that is not a tsckpt
    checkpoint. Prints one line per removed checkpoint.
    """
    from ..steps import prune

    removed = prune(root, keep, dry_run=dry_run, remove_incomplete=remove_incomplete)
    for url in removed:
        print(f"{'would remove' if dry_run else 'removed'} {url}")
    if not removed:
        print("nothing to remove")
