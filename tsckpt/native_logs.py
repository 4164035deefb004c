"""Keep the AWS SDK's own log lines off stderr while tsckpt's Python API talks to S3.

Without AWS keys in the environment, TensorStore's S3 driver asks the AWS
SDK's default credentials chain, which logs every step that finds nothing
(absent ``~/.aws`` files, an instance metadata service that does not answer)
through absl, straight to file descriptor 2, 9 lines per store opened::

    E1123 12:00:00.000000  1234 common-io:5] static: Failed to open file. path:'/root/.aws/config' ...
    E1123 12:00:00.000000  1234 aws_api.cc:6148] (id=0x55...) IMDS client failed to update the token from IMDS.

Nothing in TensorStore's Python API or environment turns them off, and
tsckpt's own error already says what is wrong and where it looked for
credentials (:mod:`tsckpt.storage.hints`). :func:`quiet` drops those lines
for the duration of a call on an ``s3://`` location that takes credentials
from that chain (no ``AWS_ACCESS_KEY_ID``): descriptor 2 goes through a pipe
to a small filter process that writes every other line to the real stderr.

What is never hidden: anything that is not one of the AWS SDK's absl lines
(Python's tracebacks and warnings, TensorStore's own absl lines, whose source
is a ``.cc`` file), absl's FATAL lines, and anything written just before a
crash: the filter is a process of its own, so it forwards what it was given
even when the caller dies. Outside tsckpt's calls, descriptor 2 is the
caller's, untouched. ``TSCKPT_NATIVE_LOGS=1`` keeps the lines. The command
line filters every absl line for its whole run (:mod:`tsckpt.cli.native_logs`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, Concatenate, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

#: Set to 1 to see the native libraries' log lines.
NATIVE_LOGS_ENV = "TSCKPT_NATIVE_LOGS"
#: One of the AWS SDK's lines, as TensorStore hands them to absl: severity I, W or E (never F), date, time,
#: thread, then the SDK's log subject where a source file would be ("common-io:5]", "AuthCredentialsProvider:
#: 6146]", no ".cc"), or "aws_api.cc:<subject>]" where the subject has no name.
AWS_SDK_LINE = rb"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ (?:aws_api\.cc|[^\]\s.]+):\d+\] "

# Runs as ``python -I -S -c``: starts in milliseconds, imports nothing of the caller's.
_FILTER = f"""
import os, re, signal
signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's to handle: its last words come through here
line = re.compile({AWS_SDK_LINE!r})
pending = b""
while True:
    chunk = os.read(0, 65536)
    if not chunk:
        break
    *lines, pending = (pending + chunk).split(b"\\n")
    out = b"".join(x + b"\\n" for x in lines if not line.match(x))
    while out:
        out = out[os.write(1, out):]
if pending and not line.match(pending):
    os.write(1, pending)
"""

_lock = threading.Lock()
_depth = 0
#: Filters still reading from a child started during their window; waited for (reaped) later.
_lingering: list[subprocess.Popen[bytes]] = []
#: The caller's descriptor 2 while a window is open, and the filter process reading the pipe.
_open: tuple[int, subprocess.Popen[bytes]] | None = None
#: Set while the command line filters descriptor 2 itself: nothing left for :func:`quiet` to do.
outer_filter = False


def is_aws_sdk_line(line: bytes) -> bool:
    """Whether ``line`` is one of the AWS SDK's log lines, which :func:`quiet` drops."""
    return re.match(AWS_SDK_LINE, line) is not None


def wanted(location: Any) -> bool:
    """Whether calls on ``location`` would print the credentials chain's lines: S3, credentials not in the environment."""
    if outer_filter or os.environ.get(NATIVE_LOGS_ENV, "").strip() not in ("", "0"):
        return False
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        return False  # tsckpt then asks for the environment's keys only, which logs nothing
    from .errors import TsckptError
    from .storage.location import parse_location

    try:
        return parse_location(location).driver == "s3"
    except (TsckptError, TypeError, ValueError):
        return False  # the call itself says what is wrong with it


@contextlib.contextmanager
def quiet(location: Any) -> Iterator[None]:
    """Drop the AWS SDK's log lines from descriptor 2 while the block runs, if calls on ``location`` print them.

    Windows opened by several threads at once share one filter, which closes
    with the last of them.
    """
    if not wanted(location):
        yield
        return
    _enter()
    try:
        yield
    finally:
        _leave()


def quiet_on(fn: Callable[Concatenate[Any, P], R]) -> Callable[Concatenate[Any, P], R]:
    """``fn(location, ...)`` run inside :func:`quiet` for its first argument, ``location``."""

    @functools.wraps(fn)
    def quietly(location: Any, *args: P.args, **kwargs: P.kwargs) -> R:
        with quiet(location):
            return fn(location, *args, **kwargs)

    return quietly


def _enter() -> None:
    global _depth, _open
    with _lock:
        _depth += 1
        if _depth > 1:
            return
        _lingering[:] = [p for p in _lingering if p.poll() is None]
        try:
            sys.stderr.flush()
            caller = os.dup(2)
        except (OSError, ValueError, AttributeError):
            return
        try:
            read_end, write_end = os.pipe()
        except OSError:
            os.close(caller)
            return
        try:
            # A session of its own: signals meant for the caller's process group (Ctrl-C, a launcher's
            # SIGTERM) must not end it before it has passed on the caller's last words.
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _FILTER], stdin=read_end, stdout=caller,
                                    stderr=caller, start_new_session=True)
        except (OSError, ValueError):  # no interpreter to run it with (an embedded Python): leave stderr as it is
            for fd in (read_end, write_end, caller):
                os.close(fd)
            return
        os.close(read_end)
        os.dup2(write_end, 2)
        os.close(write_end)
        _open = (caller, proc)


def _leave() -> None:
    global _depth, _open
    with _lock:
        _depth -= 1
        if _depth > 0 or _open is None:
            return
        caller, proc = _open
        _open = None
        with contextlib.suppress(OSError, ValueError, AttributeError):
            sys.stderr.flush()
        os.dup2(caller, 2)  # closes the pipe's last write end here: the filter reads to the end and exits
        os.close(caller)
        try:
            # What was written in the window comes out before what follows it.
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            _lingering.append(proc)  # a child started in the window holds the pipe still; the filter ends with it
