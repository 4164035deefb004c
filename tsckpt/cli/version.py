"""``tsckpt --version``: tsckpt's version and the versions of the stack it runs on."""

from __future__ import annotations

import platform
from importlib import metadata

import typer

from . import app, flag

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
