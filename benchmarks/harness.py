"""What every benchmark shares: starting gloo ranks, a cold page cache for a checkpoint, markdown tables.

* :func:`run_ranks` is the test suite's one rank spawner (``tests/dist.py``):
  ranks forked from a server that imported torch and tsckpt once, each joining a
  gloo group on loopback; rank functions return their figures.
* :func:`evict` takes one checkpoint's files out of the page cache with
  ``posix_fadvise(DONTNEED)``; dropping the whole cache (``drop_caches``) would
  evict the Python libraries too, and needs root.
* :func:`table` renders rows as a markdown table, the form every benchmark prints.
* :func:`environment` says where and when a run ran (machine, versions, date,
  load average), the header of every results file.

Importing this module puts this checkout's tsckpt and ``tests/`` (the spawner,
the moto S3 server) on ``sys.path``; it imports neither torch nor tsckpt itself.
"""

from __future__ import annotations

import os
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
#: Where results go unless a run is told otherwise: under the checkout's ignored build folder.
RESULTS = os.path.join(os.path.dirname(HERE), "build", "bench")
for _path in (os.path.join(HERE, "..", "tests"), os.path.join(HERE, "..")):
    if os.path.abspath(_path) not in map(os.path.abspath, sys.path):
        sys.path.insert(0, _path)


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks; each rank's return value, by rank.

    No time limit unless ``timeout`` (seconds) is given: a benchmark at full
    size runs for as long as it takes.
    """
    from dist import run_ranks as start

    return start(world, fn, *args, timeout=timeout)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a process group set up outside :func:`run_ranks`)."""
    from dist import free_port as port

    return port()


def evict(path: str) -> str:
    """Take every file under ``path`` (or ``path`` itself) out of the page cache; returns how ("fadvise").

    Dirty pages cannot be dropped, so each file is synced first.
    """
    files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], align: str = "") -> str:
    """A markdown table; ``align`` holds one letter per column, ``l`` or ``r`` (default: left)."""
    if any(len(row) != len(header) for row in rows):
        raise ValueError(f"every row needs {len(header)} cells: {[len(r) for r in rows]}")
    rule = "|" + "|".join("---:" if align[i:i + 1] == "r" else "---" for i in range(len(header))) + "|"
    return "\n".join([_row(header), rule, *map(_row, rows)])


def _row(cells: Sequence[Any]) -> str:
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def environment(command: str, argv: Sequence[str], modules: Sequence[str] = ("torch", "tensorstore")) -> dict[str, Any]:
    """Machine, versions of ``modules``, the command line (``command`` and ``argv``), date and load average."""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    versions = ", ".join(f"{m} {version(m)}" for m in modules)
    return {"machine": f"{os.cpu_count()} CPUs, {mem / 2**30:.0f} GiB RAM, {platform.system()} {platform.release()}, "
                       f"Python {platform.python_version()}, {versions}",
            "cpus": os.cpu_count(), "command": f"{command} {shlex.join(argv)}".strip(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_before": loadavg()}


def version(module: str) -> str:
    """The installed version of the distribution ``module``, or "not installed"."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed(module)
    except PackageNotFoundError:
        return "not installed"


def loadavg() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg()) + " (1/5/15 min)"
