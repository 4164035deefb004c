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

The held writes are let go on an event, not after a while: once the rank waits
for one of them, or once the clean-up is over (it deleted the save's claim:
then nothing waited for them). The location is
listed once the proxy has dealt with every request it got.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest
import tensorstore as ts
import torch

import tsckpt
from dist import run_ranks
from faultproxy import FaultProxy
from tsckpt.commit.states import CLAIM

BUCKET = "tsckpt-failed-writes"


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("this value cannot be pickled")


def _in_sinks(frame) -> bool:
    """Whether ``frame`` runs code of the modules where a rank's writes start (tsckpt/storage/*sinks.py)."""
    return frame.f_code.co_filename.endswith("sinks.py")


class _Watch:
    """The rank's profiler: presses Ctrl-C the instant its first write has started (``interrupt``), and says
    (by creating ``waiting``) when the rank waits for one of its writes."""

    def __init__(self, interrupt: bool, waiting: str):
        self.interrupt, self.waiting = interrupt, waiting

    def __call__(self, frame, event, arg) -> None:
        if event == "c_return" and self.interrupt and arg is ts.KvStore.write and _in_sinks(frame):
            self.interrupt = False
            signal.raise_signal(signal.SIGINT)  # its handler runs here, before the caller records the write
        elif event == "c_call" and arg is ts.Future.result and _in_sinks(frame):
            with open(self.waiting, "a"):
                pass


def _save(rank: int, world_size: int, location: dict, layout: str, failure: str, api: str,
          files: dict[str, str]) -> tuple[str, str]:
    import torch.distributed.checkpoint as dcp

    signal.signal(signal.SIGINT, signal.default_int_handler)
    state = {f"w{i}": torch.full((64, 256), float(i)) for i in range(4)}
    if failure == "error":
        state["z"] = Unpicklable()  # last: the tensors' writes are on their way when it is saved
    with open(files["pid"], "w") as f:
        f.write(str(os.getpid()))
    sys.setprofile(_Watch(failure == "ctrl-c-at-a-write-start", files["waiting"]))
    try:
        if api == "dcp":
            dcp.save(state, storage_writer=tsckpt.TensorStoreWriter(location, layout=layout))
        else:
            tsckpt.save(state, location, layout=layout)
    except BaseException as e:  # noqa: BLE001 - a KeyboardInterrupt is one of the outcomes tested
        return type(e).__name__, str(e)
    finally:
        sys.setprofile(None)
    return "ok", ""


CASES = [
    ("plain", "error", "tsckpt"),
    ("plain", "ctrl-c", "tsckpt"),
    ("plain", "ctrl-c-at-a-write-start", "tsckpt"),
    ("plain", "ctrl-c-at-a-write-start", "dcp"),
    # A packed rank on S3 sends its data file at the end of its writes (one object of at most 1 GiB here), so
    # only Ctrl-C can stop it with a write on its way; a value failing to pickle comes before any write.
    ("packed", "ctrl-c", "tsckpt"),
    ("packed", "ctrl-c-at-a-write-start", "tsckpt"),
    ("packed", "ctrl-c-at-a-write-start", "dcp"),
]


@pytest.mark.parametrize(("layout", "failure", "api"), CASES)
def test_nothing_lands_after_a_failed_saves_clean_up(s3, tmp_path, layout, failure, api):
    prefix = f"{layout}-{failure}-{api}"
    location = s3.location(BUCKET, prefix)
    files = {"pid": str(tmp_path / "pid"), "waiting": str(tmp_path / "waiting")}
    cleaned = threading.Event()

    def held(method: str, path: str) -> bool:
        if method == "DELETE" and path.endswith(CLAIM):
            cleaned.set()  # the clean-up is over: whatever is still held was waited for by nothing
        return method == "PUT" and not path.endswith(CLAIM)

    with FaultProxy(s3.endpoint) as proxy:
        proxy.hold(held)
        results: list = []
        runner = threading.Thread(target=lambda: results.extend(run_ranks(
            1, _save, {**location, "endpoint": proxy.endpoint}, layout, failure, api, files, timeout=120)))
        runner.start()
        try:
            assert proxy.holding.wait(60), "the save never wrote"
            if failure == "ctrl-c":
                with open(files["pid"]) as f:
                    os.kill(int(f.read()), signal.SIGINT)  # Ctrl-C with the rank's writes on their way
            deadline = time.monotonic() + 60
            while not (cleaned.is_set() or os.path.exists(files["waiting"])):
                assert time.monotonic() < deadline, "the rank neither waited for its writes nor cleaned up"
                cleaned.wait(0.05)
        finally:
            proxy.release()
            runner.join(150)
        assert proxy.wait_idle(), "the proxy is still forwarding"
    [(kind, message)] = results
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
    assert s3.keys(BUCKET, f"{prefix}/") == []
