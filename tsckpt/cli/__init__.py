"""The ``tsckpt`` command line: :func:`main`, ``--version`` and ``demo`` here, each other command group in
a module of its own, all on :data:`~tsckpt.cli.base.app`."""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata

import typer

from .base import INTERRUPTED, app, flag, for_cli

#: How often the command line retries a failed S3 request unless ``$TSCKPT_S3_RETRIES`` says otherwise: a person
#: waits at the terminal, and an unreachable store should say so in seconds, not after the library's minute.
CLI_S3_RETRIES = 2

#: Distributions whose versions decide how a checkpoint is written and read.
STACK = ("torch", "tensorstore", "zarr", "numpy")


def version_text() -> str:
    """``tsckpt 0.1.0 (python 3.11.7, torch 2.13.0, ...)``, without importing torch."""
    from .. import __version__

    parts = [f"python {platform.python_version()}"]
    for name in STACK:
        try:
            parts.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{name} not installed")
    return f"tsckpt {__version__} ({', '.join(parts)})"


def _print_version(value: bool) -> None:
    if value:
        print(version_text())
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = flag(False, "--version", callback=_print_version, is_eager=True,
                         help="print tsckpt's version and its stack's, then exit"),
) -> None:
    """Inspect, verify and convert tsckpt (Zarr v3) PyTorch checkpoints."""


@app.command()
def demo(
    save_ranks: int = typer.Option(4, help="CPU ranks that train and save"),
    load_ranks: int = typer.Option(2, help="CPU ranks that reload in another topology"),
    path: str = typer.Option("", help="checkpoint directory (default: a new temporary one)"),
) -> None:
    """Train a small FSDP2-sharded model on CPU ranks, save it, reload it on a different number of ranks."""
    from ..main_job import run

    run(save_ranks=save_ranks, load_ranks=load_ranks, path=path or None)


from . import verify, inspect, convert, step_chores, clean, refs  # noqa: E402,F401 - register their commands in this order


def main() -> None:
    """Entry point: a tsckpt error is one line on stderr and exit status 2, never a traceback; Ctrl-C is one line
    too (what a command that writes left where, when it says so) and exit status 130."""
    from ..storage.kvio import S3_RETRIES_ENV

    os.environ.setdefault(S3_RETRIES_ENV, str(CLI_S3_RETRIES))
    try:
        app()
    except (KeyboardInterrupt, SystemExit) as e:
        interrupt = _interrupt_in(e)
        if interrupt is None:
            raise
        print(f"interrupted: {for_cli(str(interrupt))}" if interrupt.args else "interrupted", file=sys.stderr)
        sys.exit(INTERRUPTED)


def _interrupt_in(e: BaseException) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt behind ``e``: typer turns one into a silent exit with status 130."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None
