"""A save that fails or is interrupted on S3 while its writes are on their way: nothing lands after its clean-up.

The rank's requests pass through a proxy (tests/faultproxy.py) that holds its
data writes. Meanwhile the rank fails (a value that cannot be pickled) or gets
a real SIGINT: from outside, while a write is held, or from itself at the very
instant a write has been started and not yet recorded (Python raises
``KeyboardInterrupt`` right after the call returns, and a write started then
was waited for by nothing: it landed after the clean-up, about one run in
five on a busy machine). The rank must wait for every write it started before
it reports the failure or the interrupt, so the clean-up that follows deletes
everything, and the message that says the data was removed is true.

Nothing here waits for a while: each step waits for an event, or for the
rank's process to end (then the step's outcome says why). The interrupt is
sent once the proxy holds a write; the held writes are let go once the rank
waits for one of them, or once the clean-up is over (it deleted the save's
claim: then nothing waited for them), or once the rank has ended. The rank
counts the writes it started, and the location is listed once the proxy has
dealt with that many, however late they came: one that lands after the
clean-up is listed. The only time limit, ``HANG``, stops a hung run; no step
of a run that works comes near it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import pytest
import tensorstore as ts
import torch

import tsckpt
from dist import run_ranks
from faultproxy import Client, FaultProxy
from tsckpt.commit.states import CLAIM

BUCKET = "tsckpt-failed-writes"
#: Seconds after which a hung rank is killed: a guard against a hang, never what a step waits for.
HANG = 600


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("this value cannot be pickled")


def _in_sinks(frame) -> bool:
    """Whether ``frame`` runs code of the modules where a rank's writes start (tsckpt/storage/sinks.py, byte_writes.py)."""
    return frame.f_code.co_filename.endswith(("sinks.py", "byte_writes.py"))


class _Watch:
    """The rank's profiler: presses Ctrl-C the instant its first write has started (``interrupt`` "write") or
    its first wait for a write begins ("wait"), says (by creating ``waiting``) when the rank waits for one of
    its writes, and counts the writes it started."""

    def __init__(self, interrupt: str | None, waiting: str):
        self.interrupt, self.waiting = interrupt, waiting
        self.started = 0

    def __call__(self, frame, event, arg) -> None:
        if event == "c_return" and arg is ts.KvStore.write and _in_sinks(frame):
            self.started += 1
            if self.interrupt == "write":
                self.interrupt = None
                signal.raise_signal(signal.SIGINT)  # its handler runs here, before the caller records the write
        elif event == "c_call" and arg is ts.Future.result and _in_sinks(frame):
            if self.interrupt == "wait":
                self.interrupt = None
                signal.raise_signal(signal.SIGINT)  # its handler runs here, before the wait begins
            with open(self.waiting, "a"):
                pass


def _save(rank: int, world_size: int, location: dict, layout: str, failure: str, api: str,
          files: dict[str, str]) -> tuple[str, str, int]:
    """What the save raised (its type's name and message, or "ok"), and how many writes the rank started."""
    import torch.distributed.checkpoint as dcp

    signal.signal(signal.SIGINT, signal.default_int_handler)
    state = {f"w{i}": torch.full((64, 256), float(i)) for i in range(4)}
    if failure.startswith("error"):
        state["z"] = Unpicklable()  # last: the tensors' writes are on their way when it is saved
    with open(files["pid"], "w") as f:
        f.write(str(os.getpid()))
    watch = _Watch({"ctrl-c-at-a-write-start": "write", "error-then-ctrl-c": "wait"}.get(failure), files["waiting"])
    sys.setprofile(watch)
    try:
        if api == "dcp":
            dcp.save(state, storage_writer=tsckpt.TensorStoreWriter(location, layout=layout))
        else:
            tsckpt.save(state, location, layout=layout)
    except BaseException as e:  # noqa: BLE001 - a KeyboardInterrupt is one of the outcomes tested
        return type(e).__name__, str(e), watch.started
    finally:
        sys.setprofile(None)
    return "ok", "", watch.started


CASES = [
    ("plain", "error", "tsckpt"),
    # Ctrl-C the instant the failed rank begins to wait for its writes: the first Ctrl-C, which must not cut
    # that wait short. Cut short, it leaves the writes on their way, and the clean-up after it only waits for
    # the listing to be quiet a moment (failure._settle_keys) before it says "removed".
    ("plain", "error-then-ctrl-c", "tsckpt"),
    ("plain", "error-then-ctrl-c", "dcp"),
    ("plain", "ctrl-c", "tsckpt"),
    ("plain", "ctrl-c-at-a-write-start", "tsckpt"),
    ("plain", "ctrl-c-at-a-write-start", "dcp"),
    # A packed rank on S3 sends its data file at the end of its writes (one object of at most 1 GiB here), so
    # only Ctrl-C can stop it with a write on its way; a value failing to pickle comes before any write.
    ("packed", "ctrl-c", "tsckpt"),
    ("packed", "ctrl-c-at-a-write-start", "tsckpt"),
    ("packed", "ctrl-c-at-a-write-start", "dcp"),
]


def _data(method: str, path: str) -> bool:
    """A rank's data write: every write but the claim's."""
    return method == "PUT" and not path.endswith(CLAIM)


@pytest.mark.parametrize(("layout", "failure", "api"), CASES)
def test_nothing_lands_after_a_failed_saves_clean_up(s3, tmp_path, layout, failure, api):
    prefix = f"{layout}-{failure}-{api}"
    location = s3.location(BUCKET, prefix)
    files = {"pid": str(tmp_path / "pid"), "waiting": str(tmp_path / "waiting")}
    cleaned = threading.Event()

    def held(method: str, path: str) -> bool:
        if method == "DELETE" and path.endswith(CLAIM):
            cleaned.set()  # the clean-up is over: whatever is still held was waited for by nothing
        return _data(method, path)

    with FaultProxy(s3.endpoint) as proxy:
        proxy.hold(held)
        rank = Client(lambda: run_ranks(1, _save, {**location, "endpoint": proxy.endpoint}, layout, failure, api,
                                        files, timeout=HANG)[0])
        rank.start()
        try:
            assert rank.wait_for(proxy.holding.is_set), f"the save never wrote; the rank: {rank.said()}"
            if failure == "ctrl-c":
                with open(files["pid"]) as f:
                    os.kill(int(f.read()), signal.SIGINT)  # Ctrl-C with the rank's writes on their way
            rank.wait_for(lambda: cleaned.is_set() or os.path.exists(files["waiting"]))
        finally:
            proxy.release()
            rank.join(HANG + 60)
        assert rank.result is not None, f"the rank: {rank.said()}"
        kind, message, started = rank.result
        # Every write the rank started, also one it never waited for, has reached the store or failed.
        assert proxy.wait_dealt(_data, started), "the proxy is still forwarding"
    url = f"s3://{BUCKET}/{prefix}"
    if failure == "error":
        assert kind == "SaveFailedError", message
        assert message.startswith(f"save to {url} failed on rank 0: ") and "cannot be pickled" in message
        assert message.endswith("nothing was committed; what the save had written was removed"), message
    else:
        line = f"save to {url} was interrupted (Ctrl-C on rank 0); nothing was committed; what it had staged was removed"
        if api == "dcp":  # DCP raises the coordinator's one line inside its CheckpointException
            assert kind == "CheckpointException" and f"tsckpt.errors.SaveFailedError: {line}" in message, message
        else:
            assert (kind, message) == ("KeyboardInterrupt", line)
    left = s3.keys(BUCKET, f"{prefix}/")
    assert left == [], (f"left {left} after {kind}: {message!r}; the rank started {started} writes; "
                        f"the proxy dealt with, in order: {proxy.dealt}")
