"""The ``tsckpt`` command line. Each command group lives in its own module here."""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="tsckpt",
    help="Inspect, verify and convert tsckpt (Zarr v3) PyTorch checkpoints.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Modules that register commands on ``app`` when imported.
COMMAND_MODULES: list[str] = ["demo"]


def main() -> None:
    for name in COMMAND_MODULES:
        importlib.import_module(f"{__name__}.{name}")
    app()
