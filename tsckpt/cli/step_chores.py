"""``tsckpt latest ROOT`` and ``tsckpt prune ROOT --keep K``: chores on a directory of step checkpoints.

``tsckpt ls ROOT`` on such a directory lists its steps with :func:`list_steps`.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from typing import TYPE_CHECKING, Any

import typer

from ..wording import count, human_bytes
from .base import FOUND, app, flag, print_wide

if TYPE_CHECKING:
    from ..steps import StepCheckpoint


@app.command("latest")
def latest_cmd(
    root: str = typer.Argument(..., help="directory or URL holding step checkpoints (ckpt/step_1000, ...)"),
    as_json: bool = flag(False, "--json", help="print every step entry with its state, and the latest, as JSON"),
) -> None:
    """Print the newest committed checkpoint under ROOT; exit 1 when there is none.

    The newest is the entry whose name ends with the largest integer
    (step_5_async is not a step entry); saves that have not committed
    (running or dead) and entries that are not tsckpt checkpoints are skipped.
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
    dry_run: bool = flag(False, "--dry-run", "-n", help="only print what would be removed"),
    remove_incomplete: bool = flag(
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


def _details(entry: StepCheckpoint) -> dict[str, Any]:
    """Bytes and time of one step: a committed one's tensor bytes and creation time, else what is on disk."""
    from ..commit.staging_dirs import staging_dirs, tree_state
    from ..errors import TsckptError
    from ..read import checkpoint
    from ..steps import COMMITTED, INCOMPLETE

    if entry.state == COMMITTED:
        try:
            ck = checkpoint.open(entry.location)
            return {"nbytes": ck.nbytes, "time": ck.metadata.created}
        except TsckptError:
            pass
    trees: list[str] = []
    if isinstance(entry.location, str) and "://" not in entry.location:
        if os.path.isdir(entry.location):
            trees = [entry.location]
        elif entry.state == INCOMPLETE:  # a local save, staged aside
            trees = [d.path for d in staging_dirs(os.path.abspath(entry.location))]
    if not trees:
        return {"nbytes": None, "time": None}  # an object store lists keys, not sizes: not worth a request per key
    states = [tree_state(p) for p in trees]
    newest = max(s[2] for s in states) / 1e9 or max(os.path.getmtime(p) for p in trees)
    return {"nbytes": sum(s[1] for s in states),
            "time": datetime.datetime.fromtimestamp(newest, datetime.timezone.utc).isoformat(timespec="seconds")}


def list_steps(root: str, as_json: bool) -> bool:
    """Print the step checkpoints under ``root`` (state, size, time); False when it holds none of tsckpt's."""
    from rich.markup import escape
    from rich.table import Table

    from ..steps import FOREIGN, scan

    entries = scan(root)
    if all(e.state == FOREIGN for e in entries):
        return False  # names with numbers in them, none of them a tsckpt save: not a directory of steps
    rows = [entry.to_dict() | _details(entry) for entry in entries]
    if as_json:
        print(json.dumps({"root": root, "steps": rows}, indent=1))
        return True
    table = Table(title=f"{root}: step checkpoints", title_justify="left")
    for name, justify in (("step", "right"), ("name", "left"), ("state", "left"), ("size", "right"),
                          ("time", "left")):
        table.add_column(name, justify=justify)
    for row in rows:
        table.add_row(str(row["step"]), escape(row["name"]), row["state"], human_bytes(row["nbytes"]),
                      row["time"] or "?")
    print_wide(table)
    committed = [r for r in rows if r["state"] == "committed"]
    print(f"{count(len(rows), 'step')}, {len(committed)} committed"
          + (f"; the newest committed: {committed[-1]['url']}" if committed else ""))
    for entry in entries:
        note = _leftovers(root, entry)
        if note:
            print(f"{entry.name}: {note}")
    return True


def _leftovers(root: str, entry: StepCheckpoint) -> str | None:
    """What saves into ``entry`` that did not finish left, and the command that removes it; None if nothing.

    Local saves stage in hidden directories beside their target, which the table does not show: an interrupted
    save of a new step is listed as ``incomplete``, one that was replacing a committed step not at all.
    """
    from ..commit.staging_dirs import staging_dirs
    from ..errors import TsckptError
    from ..steps import FOREIGN, INCOMPLETE
    from .clean import leftover_line

    if entry.state == FOREIGN:
        return None
    local = isinstance(entry.location, str) and "://" not in entry.location
    if local and not staging_dirs(os.path.abspath(entry.location)):
        return None  # nothing beside it: skip the lookup
    if not local and entry.state != INCOMPLETE:
        return None  # committed on an object store: a save in place leaves nothing but a claim, listed as incomplete
    try:
        return leftover_line(entry.url)
    except TsckptError as e:
        return f"cannot tell what is left ({e})"
