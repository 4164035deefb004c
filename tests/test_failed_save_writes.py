"""A save that fails or is interrupted on S3 while its writes are on their way: nothing lands after its clean-up.

The rank's requests pass through a proxy (tests/faultproxy.py) that holds its
data writes for two seconds. Meanwhile the rank fails (a value that cannot be
pickled) or gets a real SIGINT. The rank waits for every write it started
before it reports the failure or lets the interrupt go on, so the clean-up
that follows deletes everything: once the held writes have been forwarded,
the location is empty, and the message that says the data was removed is true.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

import tsckpt
from dist import run_ranks
from faultproxy import FaultProxy
from tsckpt.commit.states import CLAIM

BUCKET = "tsckpt-failed-writes"
HOLD_SECONDS = 2.0


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("this value cannot be pickled")


def _save(rank: int, world_size: int, location: dict, layout: str, failure: str, pid_file: str) -> tuple[str, str]:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    state = {f"w{i}": torch.full((64, 256), float(i)) for i in range(4)}
    if failure == "error":
        state["z"] = Unpicklable()  # last: the tensors' writes are on their way when it is saved
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    try:
        tsckpt.save(state, location, layout=layout)
    except BaseException as e:  # noqa: BLE001 - a KeyboardInterrupt is one of the outcomes tested
        return type(e).__name__, str(e)
    return "ok", ""


@pytest.mark.parametrize(("layout", "failure"), [
    ("plain", "error"),
    ("plain", "ctrl-c"),
    # A packed rank on S3 sends its data file at the end of its writes (one object of at most 1 GiB here), so
    # only Ctrl-C can stop it with a write on its way; a value failing to pickle comes before any write.
    ("packed", "ctrl-c"),
])
def test_nothing_lands_after_a_failed_saves_clean_up(s3, tmp_path, layout, failure):
    prefix = f"{layout}-{failure}"
    location = s3.location(BUCKET, prefix)
    pid_file = str(tmp_path / "pid")
    with FaultProxy(s3.endpoint) as proxy:
        proxy.hold(lambda method, path: method == "PUT" and not path.endswith(CLAIM))
        results: list = []
        runner = threading.Thread(target=lambda: results.extend(run_ranks(
            1, _save, {**location, "endpoint": proxy.endpoint}, layout, failure, pid_file, timeout=120)))
        runner.start()
        try:
            assert proxy.holding.wait(60), "the save never wrote"
            held_at = time.monotonic()
            if failure == "ctrl-c":
                with open(pid_file) as f:
                    os.kill(int(f.read()), signal.SIGINT)  # Ctrl-C with the rank's writes on their way
            time.sleep(max(0.0, held_at + HOLD_SECONDS - time.monotonic()))
        finally:
            proxy.release()
            runner.join(150)
        time.sleep(0.5)  # the held writes, forwarded now, have landed
    [(kind, message)] = results
    url = f"s3://{BUCKET}/{prefix}"
    if failure == "error":
        assert kind == "SaveFailedError", message
        assert message.startswith(f"save to {url} failed on rank 0: ") and "cannot be pickled" in message
        assert message.endswith("nothing was committed; what the save had written was removed"), message
    else:
        assert (kind, message) == ("KeyboardInterrupt", f"save to {url} was interrupted (Ctrl-C on rank 0); "
                                                         f"nothing was committed; what it had staged was removed")
    assert s3.keys(BUCKET, f"{prefix}/") == []
