"""The ``tsckpt`` command line. Each command group lives in its own module here."""

from __future__ import annotations

import importlib
import sys

import typer

from ..errors import TsckptError
from .exits import ERROR

app = typer.Typer(
    name="tsckpt",
    help="Inspect, verify and convert tsckpt (Zarr v3) PyTorch checkpoints.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Modules that register commands on ``app`` when imported.
COMMAND_MODULES: list[str] = ["version", "demo", "verify", "inspect", "convert", "steps", "clean"]


def main() -> None:
    """Entry point: a tsckpt error is one line on stderr and exit status 2 (:mod:`.exits`), never a traceback."""
    for name in COMMAND_MODULES:
        importlib.import_module(f"{__name__}.{name}")
    try:
        app()
    except TsckptError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(ERROR)
