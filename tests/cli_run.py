"""Run the ``tsckpt`` command line in a fresh process, as a user would, and check its error line."""

from __future__ import annotations

import os
import subprocess
import sys

from tsckpt.cli.base import ERROR


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``tsckpt ARGS...`` with the current interpreter; ``env`` adds to the inherited environment."""
    return subprocess.run([sys.executable, "-c", "from tsckpt.cli import main; main()", *args],
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    """The single stderr line of a command that failed cleanly (exit status ERROR, no traceback)."""
    assert result.returncode == ERROR, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]
