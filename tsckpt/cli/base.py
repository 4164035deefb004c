"""What every ``tsckpt`` command shares: the app, flags, exit statuses, error lines and wide tables.

A :class:`~tsckpt.errors.TsckptError` that a command raises is one line on stderr (:func:`failed`) and exit
status 2, with the Python keywords it names ("pass overwrite=True") given as flags (``--overwrite``).
"""

from __future__ import annotations

import re
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperCommand

from ..errors import TsckptError

#: Success: the command did its job and found nothing wrong.
OK = 0
#: The command ran and the answer is no: ``verify`` found damage, ``diff`` found differences.
FOUND = 1
#: The command could not do its job: bad input, or a missing, incomplete or unreadable
#: checkpoint. Command-line usage errors exit with 2 too.
ERROR = 2
#: Ctrl-C stopped the command (128 + SIGINT, as a shell reports a program that Ctrl-C ended).
INTERRUPTED = 130

#: Python keywords in messages, and the flag that says the same at the command line.
FLAGS = {"overwrite": "--overwrite", "trust_pickle": "--trust-pickle", "allow_pickle": "--allow-pickle",
         "force": "--force"}
# "overwrite=True", or "trust_pickle=True (--trust-pickle)" where a message names both.
_KEYWORD = re.compile(r"\b(" + "|".join(FLAGS) + r")=True(?: \(--[\w-]+\))?")


def for_cli(message: str) -> str:
    """``message`` with every Python keyword that has a flag replaced by the flag."""
    return _KEYWORD.sub(lambda m: FLAGS[m.group(1)], message)


def failed(e: TsckptError, label: str = "error:") -> typer.Exit:
    """Print ``label`` and the error's message (flags named as such) on stderr; the exit to raise."""
    Console(stderr=True).print(f"[bold red]{escape(label)}[/] {escape(for_cli(str(e)))}", highlight=False,
                               soft_wrap=True)
    return typer.Exit(ERROR)


class _Command(TyperCommand):
    """A command whose ``--help`` row, like every flag's, shows no ``<bool>``, and whose tsckpt errors are
    one line and exit status :data:`ERROR`."""

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)
        if option is not None:
            option.metavar = ""
        return option

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except TsckptError as e:
            raise failed(e) from None


class _App(typer.Typer):
    def command(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("cls", _Command)
        return super().command(*args, **kwargs)


app = _App(
    name="tsckpt",
    help="Inspect, verify and convert tsckpt (Zarr v3) PyTorch checkpoints.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def flag(default: bool | None, *param_decls: str, **kwargs: Any) -> Any:
    """A typer option that is an on/off flag: its help row shows no ``<bool>``, since a flag takes no value."""
    return typer.Option(default, *param_decls, metavar="", **kwargs)


def print_wide(table: Table, console: Console | None = None) -> None:
    """In a terminal the table fits the window; piped, it takes its natural width, so no cell is cut."""
    console = console or Console()
    if console.is_terminal:
        console.print(table, highlight=False)
    else:
        width = console.measure(table, options=console.options.update_width(1 << 16)).maximum
        Console(width=max(width, 20), file=console.file).print(table, highlight=False)
