"""``tsckpt convert SRC DST`` and ``tsckpt diff A B``."""

from __future__ import annotations

import os
import re
import sys
import warnings
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..errors import TsckptError
from ..wording import count
from .base import FOUND, OK, app, flag, print_wide

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """``"5GB"``, ``"500MiB"`` or a plain byte count, as bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise typer.BadParameter(f"{text!r} is not a size; expected e.g. 5GB, 500MiB or 1000000")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@app.command("convert")
def convert_cmd(
    src: str = typer.Argument(..., help="tsckpt dir, DCP dir, torch.save file, .safetensors or HF shard dir"),
    dst: str = typer.Argument(..., help="where to write the converted checkpoint"),
    to: str = typer.Option("", "--to", help="tsckpt, dcp, torch or safetensors (default: from DST's suffix: "
                                          ".safetensors, .pt/.pth/.bin, else tsckpt)"),
    max_shard_size: str = typer.Option("", help="safetensors shard limit, e.g. 5GB: writes an HF directory"),
    trust_pickle: bool = flag(False, "--trust-pickle",
                              help="allow unpickling SRC (needed for DCP .metadata); can run code from it"),
    overwrite: bool = flag(False, "--overwrite", help="replace what is at DST"),
    layout: str = typer.Option("", "--layout",
                               help="tsckpt target storage: plain (a file per chunk) or packed (few large files); "
                                    "default: $TSCKPT_LAYOUT, else packed"),
    quiet: bool = flag(False, "--quiet", "-q", help="no progress bar"),
) -> None:
    """Convert a checkpoint between tsckpt, DCP, torch.save and safetensors, one tensor at a time."""
    from ..conversion.convert import ConversionWarning, convert, default_target

    shard = parse_size(max_shard_size) if max_shard_size else None
    err = Console(stderr=True)
    target = to or default_target(dst, shard)
    existed = os.path.lexists(dst)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConversionWarning)  # printed below from the result
            result = convert(src, dst, to=to or None, trust_pickle=trust_pickle,
                             overwrite=overwrite, max_shard_size=shard, layout=layout or None,
                             progress=not quiet and err.is_terminal)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(_interrupted(dst, target, existed)) from None
    for note in result.warnings:
        err.print(f"[yellow]warning:[/yellow] {note}", highlight=False, soft_wrap=True)
    err.print(f"{result.source_format} -> {result.target_format}: {count(result.tensors, 'tensor')}, "
              f"{count(result.objects, 'value')}, {result.nbytes / 1e6:.1f} MB in {result.seconds:.2f} s "
              f"({result.mb_per_s:.0f} MB/s)", highlight=False)


def _interrupted(dst: str, target: str, existed: bool) -> str:
    """What Ctrl-C during ``convert`` left at ``dst``, in one line."""
    line = f"convert to {dst} was interrupted (Ctrl-C)"
    if target == "tsckpt":
        # The checkpoint builder removed its staging on the way out; a leftover is what it could not.
        from .clean import leftover_line

        try:
            left = leftover_line(dst)
        except TsckptError as e:
            left = str(e)
        return f"{line}; nothing was committed" + (f"; {left}" if left else ", and what it had staged was removed")
    partial = [p for p in (dst + ".partial", dst) if os.path.lexists(p) and (p != dst or not existed)]
    if not partial:
        return f"{line}; nothing was written there"
    state = "are incomplete: remove them" if len(partial) > 1 else "is incomplete: remove it"
    return f"{line}; {' and '.join(partial)} {state}"


def _side(e: Any, which: str) -> str:
    """One side of a diff row: dtype[shape], the plain value, or '-' when absent."""
    dtype, shape, value = (e.dtype_a, e.shape_a, e.value_a) if which == "a" else (e.dtype_b, e.shape_b, e.value_b)
    if shape is not None:
        return f"{dtype}{list(shape)}"
    if value is not None:
        return escape(value if len(value) <= 60 else value[:59] + "…")
    return "-" if e.status == ("only_b" if which == "a" else "only_a") else e.kind


@app.command("diff")
def diff_cmd(
    a: str = typer.Argument(..., help="first checkpoint (any supported format)"),
    b: str = typer.Argument(..., help="second checkpoint (any supported format)"),
    trust_pickle: bool = flag(False, "--trust-pickle", help="allow unpickling (needed for DCP dirs)"),
    show_equal: bool = flag(False, "--all", help="list equal entries too"),
    rtol: float = typer.Option(0.0, "--rtol", min=0.0, help="relative tolerance for tensors: |A-B| <= atol + rtol*|B|"),
    atol: float = typer.Option(0.0, "--atol", min=0.0, help="absolute tolerance for tensors"),
) -> None:
    """Compare two checkpoints key by key. Exit code 0 when identical (or within --rtol/--atol), 1 when they differ, 2 on errors.

    Tensors of the same shape and dtype whose elements all lie within the
    tolerances are reported as "close" and do not count as differences.
    """
    from ..conversion.diff import diff

    result = diff(a, b, trust_pickle=trust_pickle, rtol=rtol, atol=atol)
    out = Console()
    rows = result.entries if show_equal else result.differences
    if rows:
        table = Table(title=f"A = {a} ({result.format_a})\nB = {b} ({result.format_b})")
        for col in ("key", "status", "A", "B", "max |A-B|"):
            table.add_column(col, overflow="fold")
        for e in rows:
            side = [_side(e, "a"), _side(e, "b")]
            style = "green" if e.equal else "yellow" if e.matches else "red"
            mad = "" if e.max_abs_diff is None else f"{e.max_abs_diff:.6g}"
            table.add_row(escape(e.key), f"[{style}]{e.status}[/{style}]", side[0], side[1], mad)
        print_wide(table, out)  # piped or redirected: rows at full width, never wrapped at 80 columns
    n_diff = len(result.differences)
    if n_diff:
        out.print(f"[red]{n_diff} of {len(result.entries)} entries differ[/red]", soft_wrap=True)
    elif not result.identical:
        close = sum(e.status == "close" for e in result.entries)
        out.print(f"[green]equal within tolerance[/green]: {len(result.entries)} entries, {close} close but not "
                  f"bit-identical", soft_wrap=True)
    else:
        out.print(f"[green]identical[/green]: {len(result.entries)} entries", soft_wrap=True)
    sys.stdout.flush()
    raise typer.Exit(FOUND if n_diff else OK)
