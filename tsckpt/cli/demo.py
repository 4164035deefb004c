"""``tsckpt demo``: the main job (save on several CPU ranks, reload in another topology)."""

from __future__ import annotations

import typer

from . import app


@app.command()
def demo(
    save_ranks: int = typer.Option(4, help="CPU ranks that train and save"),
    load_ranks: int = typer.Option(2, help="CPU ranks that reload in another topology"),
    path: str = typer.Option("", help="checkpoint directory (default: a new temporary one)"),
) -> None:
    """Train a small FSDP2-sharded model on CPU ranks, save it, reload it on a different number of ranks."""
    from ..main_job import run

    run(save_ranks=save_ranks, load_ranks=load_ranks, path=path or None)
