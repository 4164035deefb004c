"""Repeat one packed 4 -> 2 resharded load many times and count ranks that die.

A whole-suite run with ``TSCKPT_LAYOUT=packed`` on Python 3.13 + torch 2.15 once
lost a spawned rank to SIGABRT ("terminate called without an active
exception") in ``tests/test_distributed.py::test_reshard_4_ranks_to_2``. This
saves the test's 4-rank zoo once, packed, then runs that test's 2-rank load
``--runs`` times with the test suite's own rank harness, and reports each
failure and the count. The loading ranks are whole interpreters (spawned, not
forked from the suite's forkserver) so that they finalize at exit, where the
abort happened. Each rank prints a marker to stderr once its load returned, so
a failure without the marker died inside the load, and one with it died
afterwards; a second marker at ``atexit`` tells process-group teardown from
interpreter exit, and ``faulthandler`` prints the Python stacks of an abort.

    python tools/loop_packed_reshard.py --runs 70
"""

from __future__ import annotations

import argparse
import atexit
import faulthandler
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # the suite's harness and zoo
sys.path.insert(0, os.path.join(HERE, ".."))  # this checkout's tsckpt

from dist import run_ranks  # noqa: E402
import test_distributed as td  # noqa: E402
import zoo  # noqa: E402


def load_marked(rank: int, world: int, path: str) -> list[str]:
    faulthandler.enable()  # an abort prints every thread's Python stack
    bad = td.load_resharded(rank, world, path, "")
    mark(rank, "finished its load")
    atexit.register(mark, rank, "reached interpreter exit (after the process group was destroyed)")
    return bad


def mark(rank: int, what: str) -> None:
    print(f"rank {rank} (pid {os.getpid()}) {what}", file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=70)
    ap.add_argument("--layout", default="packed", help="the layout saved and loaded (plain, to compare)")
    args = ap.parse_args()
    path = os.path.join(tempfile.mkdtemp(prefix="tsckpt-loop-"), "ckpt")
    os.environ["TSCKPT_LAYOUT"] = args.layout  # the spawned ranks inherit it
    run_ranks(4, zoo.save_zoo, path, args.layout)
    failures = 0
    for i in range(args.runs):
        try:
            got = run_ranks(2, load_marked, path, whole_interpreters=True)
            assert got == [[], []], got
        except AssertionError as e:
            failures += 1
            print(f"run {i}: {str(e).strip()[-300:]}", flush=True)
    print(f"{failures} of {args.runs} runs lost a rank or loaded wrong data")


if __name__ == "__main__":
    main()
