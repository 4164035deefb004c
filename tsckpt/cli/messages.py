"""How the command line reports an error: one line on stderr, naming command-line flags.

The library's messages name Python keywords ("pass overwrite=True to replace
it"); at the command line the same advice is a flag (``--overwrite``).
:func:`for_cli` rewrites the keywords that have a flag, and :func:`failed`
prints the line every command prints for a :class:`~tsckpt.errors.TsckptError`.
"""

from __future__ import annotations

import re

import typer
from rich.console import Console
from rich.markup import escape

from ..errors import TsckptError
from .exits import ERROR

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
