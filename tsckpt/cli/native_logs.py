"""Keep the log lines of TensorStore's C++ libraries off the command line's stderr.

Without AWS credentials in the environment, the AWS SDK inside TensorStore
logs every step of its credentials chain (missing ``~/.aws`` files, the
instance metadata service) through absl, straight to file descriptor 2:
lines like ``E1123 12:00:00.000000  1234 aws_api.cc:61] IMDS client failed``
before the one line that says what is wrong. Nothing in TensorStore's Python
API or environment turns those off, so the command line reads descriptor 2
itself while it runs: absl-formatted lines are dropped, everything else goes
through. Python's own ``sys.stderr`` is re-opened on the real stderr, so
tracebacks, warnings and progress bars (which ask whether stderr is a
terminal) are untouched. ``TSCKPT_NATIVE_LOGS=1`` keeps the native lines.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from collections.abc import Iterator

from .. import native_logs as library

#: Set to 1 to see the native libraries' log lines.
NATIVE_LOGS_ENV = "TSCKPT_NATIVE_LOGS"
#: absl's prefix: severity and date, time, thread id, "file:line]".
_ABSL_LINE = re.compile(rb"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ [^\]\s]+:\d+\] ")


def is_native_log(line: bytes) -> bool:
    """Whether ``line`` is one of absl's log lines."""
    return _ABSL_LINE.match(line) is not None


def _pump(source: int, sink: int) -> None:
    """Copy ``source`` to ``sink`` line by line, without absl's lines, until ``source`` closes."""
    pending = b""
    while True:
        try:
            chunk = os.read(source, 65536)
        except OSError:
            break
        if not chunk:
            break
        *lines, pending = (pending + chunk).split(b"\n")
        _write(sink, b"".join(line + b"\n" for line in lines if not is_native_log(line)))
    if pending and not is_native_log(pending):
        _write(sink, pending)
    os.close(source)


def _write(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


@contextlib.contextmanager
def native_logs_filtered() -> Iterator[None]:
    """Filter descriptor 2 for the duration (see the module docstring); a no-op where it cannot."""
    if os.environ.get(NATIVE_LOGS_ENV, "").strip() not in ("", "0"):
        yield
        return
    try:
        sys.stderr.flush()
        real = os.dup(2)
        read_end, write_end = os.pipe()
    except (OSError, ValueError, AttributeError):
        yield
        return
    python_stderr = sys.stderr
    library.outer_filter = True  # the library's own filter (tsckpt.native_logs) has nothing left to drop
    sys.stderr = open(real, "w", buffering=1, encoding=getattr(python_stderr, "encoding", None) or "utf-8",
                      errors="backslashreplace", closefd=False)
    os.dup2(write_end, 2)
    os.close(write_end)
    pump = threading.Thread(target=_pump, args=(read_end, real), name="native-log-filter", daemon=True)
    pump.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        sys.stderr = python_stderr
        os.dup2(real, 2)  # closes the pipe's last write end: the pump sees the end and stops
        pump.join(timeout=5)
        os.close(real)
        library.outer_filter = False
