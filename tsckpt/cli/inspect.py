"""``tsckpt ls``, ``tsckpt show`` and ``tsckpt info``: look inside a checkpoint without torch.distributed."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from ..errors import TsckptError
from ..wording import count, human_bytes
from . import summary
from .base import app, flag, print_wide

out = Console()


def _short(value: Any, width: int = 48) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 1] + "…"


@app.command("ls")
def ls(
    path: str = typer.Argument(..., help="checkpoint directory or URL, or a directory of step checkpoints"),
    as_json: bool = flag(False, "--json", help="print the listing as JSON (keys: see tsckpt.cli.summary)"),
) -> None:
    """List tensors and values as a tree, with shape, dtype, size and placement.

    On a directory of step checkpoints (ckpt/step_1000, ...), list the steps: state, size and time.
    """
    from ..read import checkpoint

    try:
        ck = checkpoint.open(path)
    except TsckptError as e:
        from .step_chores import list_steps

        try:
            if list_steps(path, as_json):
                return
        except TsckptError:
            pass
        raise e from None
    if as_json:
        print(json.dumps(summary.listing(ck), indent=1, allow_nan=False))
        return
    print_wide(_tree_table(ck, list(ck), title=ck.url), out)
    out.print(f"{count(len(ck.metadata.tensors), 'tensor')}, {human_bytes(ck.nbytes)}; "
              f"{count(len(ck.metadata.objects), 'value')}; world size {ck.world_size}", highlight=False)
    _print_open_line(path)


def _print_open_line(path: str) -> None:
    """The zarr-python line that opens the checkpoint by URL: printed as it is, since a console would wrap it
    and read brackets in a path as markup, and it must paste as one line of Python."""
    from ..read.url import open_line

    print(open_line(path), flush=True)


def _tree_table(ck: Any, keys: list[str], title: str) -> Table:
    """``keys`` of ``ck`` as rows of a tree, with a row for each group above them."""
    table = Table(title=title, title_justify="left")
    wanted = set(keys)
    for name, justify in (("key", "left"), ("shape", "left"), ("dtype", "left"),
                          ("size", "right"), ("placement", "left")):
        table.add_column(name, justify=justify, overflow="fold")
    rows = [(e.key_path, key, True) for key, e in ck.metadata.tensors.items() if key in wanted]
    rows += [(e.key_path, key, False) for key, e in ck.metadata.objects.items() if key in wanted]
    shown: set[tuple[Any, ...]] = set()
    for key_path, key, is_tensor in sorted(rows, key=lambda r: [str(p) for p in r[0]]):
        for depth in range(1, len(key_path)):
            group = tuple(key_path[:depth])
            if group not in shown:
                shown.add(group)
                table.add_row("  " * (depth - 1) + f"[bold]{group[-1]}/[/]", "", "", "", "")
        label = "  " * (len(key_path) - 1) + str(key_path[-1])
        if is_tensor:
            h = ck.tensors[key]
            table.add_row(label, str(list(h.shape)), h.zarr_dtype, human_bytes(h.nbytes), h.placement_text)
        else:
            entry = ck.metadata.objects[key]
            shown_value = _short(ck[key]) if entry.encoding == "json" else "(torch-serialized value)"
            table.add_row(label, "", "value", "", shown_value)
    return table


def _stats(a: np.ndarray) -> dict[str, str]:
    if a.size == 0:
        return {"elements": "0"}
    if a.dtype.kind == "c":
        mags = np.abs(a.astype(np.complex128))
        return {"elements": str(a.size), "|min|": f"{mags.min():.6g}", "|max|": f"{mags.max():.6g}",
                "mean": f"{a.astype(np.complex128).mean():.6g}"}
    x = a.astype(np.float64)
    finite = x[np.isfinite(x)]
    stats = {"elements": str(a.size)}
    if finite.size:
        stats |= {"min": f"{finite.min():.6g}", "max": f"{finite.max():.6g}",
                  "mean": f"{finite.mean():.6g}", "std": f"{finite.std():.6g}"}
    nonfinite = a.size - finite.size
    if nonfinite:
        stats |= {"nan": str(int(np.isnan(x).sum())), "inf": str(int(np.isinf(x).sum()))}
    return stats


@app.command("show", context_settings={"ignore_unknown_options": True})
def show(
    path: str = typer.Argument(..., help="checkpoint directory or URL"),
    key: str = typer.Argument(..., help="flat key (model.layers.0.weight) or a group (model.layers) to list"),
    index: str = typer.Argument("", metavar="[SLICE]",
                                help='numpy-style selection, e.g. "0:4,2" or -1; also for lists, tuples, strings'),
    allow_pickle: bool = flag(False, help="decode values that need arbitrary unpickling"),
) -> None:
    """Print a tensor (or a slice of it) with min/max/mean/std, a value, or what is under a group."""
    from ..read import checkpoint, index as indices

    if index.startswith("--"):  # negative indices pass as arguments, so an unknown option lands here
        raise typer.BadParameter(f"no such option: {index}")
    ck = checkpoint.open(path, allow_pickle=allow_pickle)
    if key not in ck and (under := summary.members(ck, key)):
        out.print(f"{key} is a group of {len(under)} entries:", highlight=False, markup=False)
        print_wide(_tree_table(ck, under, title=""), out)
        return
    if key not in ck.tensors:
        value = ck[key]
        out.print(repr(summary.select_value(value, index, key) if index else value), highlight=False)
        return
    h = ck.tensors[key]
    selection = indices.parse_index(index) if index else ()
    a = h.numpy(selection)
    where = f"{key}[{index}]" if index else key
    out.print(f"[bold]{where}[/]  shape {list(a.shape)} of {list(h.shape)}  {h.zarr_dtype}  "
              f"{h.placement_text}", highlight=False)
    with np.printoptions(threshold=200, edgeitems=3, linewidth=max(out.width, 80)):
        out.print(str(a), highlight=False, markup=False)
    stats = _stats(a)
    table = Table(show_header=True)
    for name in stats:
        table.add_column(name, justify="right")
    table.add_row(*stats.values())
    out.print(table)


@app.command("info")
def info(
    path: str = typer.Argument(..., help="checkpoint directory or URL"),
    as_json: bool = flag(False, "--json", help="print the facts as JSON (keys: see tsckpt.cli.summary)"),
) -> None:
    """Mesh, world size, versions, file count and bytes of a checkpoint."""
    from ..read import checkpoint

    ck = checkpoint.open(path)
    if as_json:
        print(json.dumps(summary.information(ck), indent=1, allow_nan=False))
        return
    md = ck.metadata
    files, stored = ck.storage_stats()
    table = Table(show_header=False, title=ck.url, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("format version", str(md.version)),
        ("written by", f"tsckpt {md.tsckpt_version or '?'}, torch {md.torch_version or '?'}"),
        ("created", md.created or "?"),
        ("world size", str(md.world_size)),
    ]
    for i, mesh in enumerate(md.meshes):
        names = f" ({', '.join(mesh.dim_names)})" if mesh.dim_names else ""
        rows.append((f"mesh {i}", f"{mesh.device_type} {list(mesh.shape)}{names}, ranks {list(mesh.ranks)}"))
    if not md.meshes:
        rows.append(("mesh", "none (no DTensors)"))
    rows += [
        ("tensors", f"{len(md.tensors)} ({human_bytes(ck.nbytes)} of data)"),
        ("values", str(len(md.objects))),
        ("layout", md.layout),
        ("files", str(files)),
        ("bytes stored", f"{human_bytes(stored)} ({stored} B)" if stored is not None else
         "not known here: TensorStore lists an object store's keys without their sizes; the bucket's own "
         "listing (aws s3 ls --summarize --recursive) has them"),
    ]
    if md.reuse is not None:
        rows += [("base", md.reuse.base + (f" (save {md.reuse.base_save_id})" if md.reuse.base_save_id else "")),
                 ("written / reused", f"{human_bytes(md.reuse.bytes_written)} written, "
                                      f"{human_bytes(md.reuse.bytes_reused)} reused from the base "
                                      f"({md.reuse.chunks_reused} chunks)"
                                      + (f"; {md.reuse.note}" if md.reuse.note else ""))]
    from .clean import leftover_line

    left = leftover_line(path)
    if left:
        rows.append(("leftovers", left))
    for name, value in rows:
        table.add_row(name, value)
    print_wide(table, out)
    _print_open_line(path)
