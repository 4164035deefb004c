"""The ``tsckpt`` command line. Each command group lives in its own module here."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import typer
from typer.core import TyperCommand

from ..errors import TsckptError
from .exits import ERROR, INTERRUPTED


class _Command(TyperCommand):
    """A command whose ``--help`` row, like every flag's, shows no ``<bool>``."""

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)
        if option is not None:
            option.metavar = ""
        return option


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


# Modules that register commands on ``app`` when imported.
COMMAND_MODULES: list[str] = ["version", "demo", "verify", "inspect", "convert", "step_chores", "clean", "refs"]


#: How often the command line retries a failed S3 request unless ``$TSCKPT_S3_RETRIES`` says otherwise:
#: a person waits at the terminal, and an unreachable store or a wrong endpoint should say so in seconds,
#: not after the library's minute of retries.
CLI_S3_RETRIES = 2


def main() -> None:
    """Entry point: a tsckpt error is one line on stderr and exit status 2 (:mod:`.exits`), never a traceback.

    Ctrl-C is one line too (what a command that writes left where, when it says so) and exit status 130.
    """
    from ..storage.kvio import S3_RETRIES_ENV
    from .messages import for_cli

    os.environ.setdefault(S3_RETRIES_ENV, str(CLI_S3_RETRIES))
    for name in COMMAND_MODULES:
        importlib.import_module(f"{__name__}.{name}")
    try:
        app()
    except TsckptError as e:
        print(f"error: {for_cli(str(e))}", file=sys.stderr)
        sys.exit(ERROR)
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
