"""``tsckpt refs PATH``: a reference file through which zarr-python reads a packed checkpoint without tsckpt."""

from __future__ import annotations

import os

import typer

from .base import app


@app.command("refs")
def refs(
    path: str = typer.Argument(..., help="a packed checkpoint: directory or URL"),
    output: str = typer.Option("", "-o", "--output", metavar="OUT",
                               help="the file to write (default: <name>.refs.json in the current directory)"),
    name: str = typer.Option("", "--name", help="the top-level name of the keys (default: the directory's name)"),
) -> None:
    """Write a kerchunk reference file: zarr-python and fsspec open the packed layout with it, no tsckpt needed."""
    from ..read import refs as references

    try:
        name = name or references.default_name(path)
        out = output or f"{name}.refs.json"
        if os.path.isdir(out):
            out = os.path.join(out, f"{name}.refs.json")
        references.write_references(path, out, name=name)
    except OSError as e:
        raise typer.BadParameter(f"cannot write {out}: {e.strerror or e}", param_hint="-o") from None
    print(f"wrote {out}; with only zarr and fsspec installed:")
    print(references.open_line(out, name, path))
