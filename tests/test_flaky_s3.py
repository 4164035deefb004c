"""Checkpoints through a flaky object store: a fault-injecting proxy (tests/faultproxy.py) in front of moto.

A share of the requests is refused, answered 500 or 503, reset half-way
through the answer, or stalled. Transient faults are ridden out by
TensorStore's retries; persistent ones fail the save or load in bounded time
with one line. Whatever happens, nothing committed is missing data, and no
load returns data that fails its checksum. Each test prints how many requests
were faulted and how many saves and loads survived.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

import tsckpt
from cli_run import one_line_error, run_cli
from dist import run_ranks
from faultproxy import TRANSIENT, FaultProxy
from s3server import MotoServer, restore_credentials, set_credentials
from tsckpt.errors import ChecksumError, SaveFailedError, TsckptError
from tsckpt.storage.context import make_context, open_kvstore
from tsckpt.storage.location import parse_location

BUCKET = "flaky-test"
#: Quick retries, so a test rides out dozens of faults in seconds (the defaults wait up to 16 s each).
FAST = {"s3_request_retries": {"max_retries": 10, "initial_delay": "0.05s", "max_delay": "0.4s"}}
#: Few retries: persistent faults fail quickly.
FEW = {"s3_request_retries": {"max_retries": 2, "initial_delay": "0.05s", "max_delay": "0.1s"}}


@pytest.fixture(scope="module")
def s3():
    previous = set_credentials()  # before any rank is spawned: ranks inherit the environment
    with MotoServer() as server:
        server.create_bucket(BUCKET)
        yield server
    restore_credentials(previous)


def _loc(endpoint: str, prefix: str, context: dict = FAST) -> dict:
    return {"url": f"s3://{BUCKET}/{prefix}", "endpoint": endpoint, "context": context}


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(96, 64, generator=g), "b": torch.randn(64, generator=g).bfloat16()},
            "opt": {"step": seed, "lr": 0.5}}


def _empty() -> dict:
    return {"model": {"w": torch.zeros(96, 64), "b": torch.zeros(64, dtype=torch.bfloat16)},
            "opt": {"step": None, "lr": None}}


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a["model"][k].view(torch.int16), b["model"][k].view(torch.int16)) for k in ("w", "b")) \
        and a["opt"] == b["opt"]


def _keys(s3, prefix: str) -> list[str]:
    """Every object under ``prefix``, asked of moto directly (not through the proxy)."""
    kv = open_kvstore(parse_location(_loc(s3.endpoint, "")), make_context())
    return sorted(k.decode() for k in kv.list().result() if k.decode().startswith(prefix + "/"))


def _committed_and_whole(s3, prefix: str) -> bool | None:
    """None when nothing is committed at ``prefix``; else whether every chunk verifies (asked directly)."""
    if f"{prefix}/zarr.json" not in _keys(s3, prefix):
        return None
    return tsckpt.verify(_loc(s3.endpoint, prefix)).ok


def test_transient_faults_are_ridden_out_by_retries(s3):
    saves = loads = 0
    rounds = 6
    with FaultProxy(s3.endpoint, rate=0.25, kinds=TRANSIENT, seed=1, stall_seconds=1.0) as proxy:
        for i in range(rounds):
            # Fresh prefixes, and overwrites of the previous round's checkpoint.
            prefix = f"transient/{i // 2}"
            tsckpt.save(_state(i), _loc(proxy.endpoint, prefix), overwrite=True)
            assert _committed_and_whole(s3, prefix) is True
            saves += 1
            back = _empty()
            tsckpt.load(back, _loc(proxy.endpoint, prefix))
            assert _same(back, _state(i))
            loads += 1
        print(f"\n25% of requests faulted: {proxy.summary()}; {saves}/{rounds} saves and {loads}/{rounds} loads "
              f"survived")
        assert all(proxy.counts[kind] > 0 for kind in TRANSIENT), proxy.counts
        assert proxy.faulted >= 20


def _save_and_load(rank, world, location, seed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = _state(seed)
    sd = {"model": {"w": distribute_tensor(full["model"]["w"], mesh, [Shard(0)], src_data_rank=None),
                    "b": full["model"]["b"]}, "opt": full["opt"]}
    tsckpt.save(sd, location)
    back = _empty()
    tsckpt.load(back, location)
    return _same(back, full)


def test_four_ranks_save_and_load_through_transient_faults(s3):
    with FaultProxy(s3.endpoint, rate=0.2, kinds=TRANSIENT, seed=2, stall_seconds=1.0) as proxy:
        survived = run_ranks(4, _save_and_load, _loc(proxy.endpoint, "ranks4"), 7)
        print(f"\n20% of requests faulted, 4 ranks: {proxy.summary()}; the save and {sum(survived)}/4 loads survived")
        assert survived == [True] * 4 and proxy.faulted > 0
    assert _committed_and_whole(s3, "ranks4") is True


@pytest.mark.parametrize("kinds", [("refuse", "500", "503", "reset"), ("503",)])
def test_persistent_faults_fail_soon_with_one_line(s3, kinds):
    tsckpt.save(_state(0), _loc(s3.endpoint, "persistent"), overwrite=True)
    with FaultProxy(s3.endpoint, rate=1.0, kinds=kinds, seed=3) as proxy:
        start = time.monotonic()
        with pytest.raises(TsckptError) as saving:
            tsckpt.save(_state(1), _loc(proxy.endpoint, "persistent", FEW), overwrite=True)
        with pytest.raises(TsckptError) as loading:
            tsckpt.load(_empty(), _loc(proxy.endpoint, "persistent", FEW))
        seconds = time.monotonic() - start
        for error in (saving.value, loading.value):
            first = str(error).splitlines()[0]
            assert "retries" in first and f"s3://{BUCKET}/persistent" in first, first
        print(f"\nevery request faulted ({', '.join(kinds)}): {proxy.summary()}; the save and the load each failed "
              f"with one line, after {seconds:.1f} s together:\n  {str(saving.value).splitlines()[0]}\n  "
              f"{str(loading.value).splitlines()[0]}")
    # Whatever the failed overwrite did, nothing committed there is missing data.
    assert _committed_and_whole(s3, "persistent") in (None, True)


def test_a_stalled_store_fails_in_bounded_time_with_one_line(s3):
    # Without an answer, a request gives up after TensorStore's low-speed limit (60 s by default),
    # then it is retried: 2 s and 1 retry here, so a hung store fails a command in seconds.
    tsckpt.save(_state(0), _loc(s3.endpoint, "stalled"), overwrite=True)
    with FaultProxy(s3.endpoint, rate=1.0, kinds=("stall",), stall_seconds=120) as proxy:
        result = run_cli("ls", f"s3://{BUCKET}/stalled", env={
            "AWS_ENDPOINT_URL": proxy.endpoint, "TSCKPT_S3_RETRIES": "1",
            "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS": "2"}, timeout=100)
        line = one_line_error(result)
        print(f"\nevery request stalled: {proxy.summary()}; `tsckpt ls` failed with: {line}")
        assert "retries" in line and f"s3://{BUCKET}/stalled" in line


def test_refused_credentials_are_one_line_that_says_so_without_the_sdks_log(s3, monkeypatch, tmp_path):
    # No credentials anywhere: tsckpt sends unsigned requests, which ask no source of the AWS SDK (each would log
    # to stderr that it found nothing), and names the credentials as the cause of the 403.
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("HOME", str(tmp_path))
    with FaultProxy(s3.endpoint, rate=1.0, kinds=("denied",)) as proxy:
        result = run_cli("ls", f"s3://{BUCKET}/denied", env={"AWS_ENDPOINT_URL": proxy.endpoint,
                                                              "AWS_EC2_METADATA_DISABLED": "true"})
        line = one_line_error(result)  # exactly one line on stderr
        assert line.startswith(f"error: cannot read 'zarr.json' at s3://{BUCKET}/denied: ")
        assert "AccessDenied" in line and "check the credentials (none found" in line
        print(f"\n403 on every request: {proxy.summary()}; `tsckpt ls` said: {line}")


@pytest.mark.parametrize("after", [1, 3, 5, 7, 9, 11, 13, 15])
def test_a_store_lost_mid_save_never_commits_missing_data(s3, after):
    # A save here takes about 17 requests: the store goes away before, during or after its data, or at
    # its commit. The save either commits a whole checkpoint or fails, naming the location, and what it
    # could not remove is removed by `tsckpt clean --force` once the store is back.
    prefix = f"lost/{after}"
    with FaultProxy(s3.endpoint, seed=4) as proxy:
        proxy.set(rate=1.0, kinds=("refuse", "503"), after=after)
        try:
            tsckpt.save(_state(after), _loc(proxy.endpoint, prefix, FEW))
            outcome = "committed"
        except TsckptError as e:
            outcome = f"{type(e).__name__}: {e}"
        print(f"\nstore lost after {after} requests: {proxy.summary()}; save: {outcome}")
    if outcome != "committed":
        assert f"s3://{BUCKET}/{prefix}" in outcome.splitlines()[0]
        assert "gave up after 2 retries" in outcome
    assert _committed_and_whole(s3, prefix) is (True if outcome == "committed" else None)
    tsckpt.clean(_loc(s3.endpoint, prefix), force=True)
    if outcome != "committed":
        assert _keys(s3, prefix) == []
    tsckpt.save(_state(after + 1), _loc(s3.endpoint, prefix), overwrite=True)
    assert _committed_and_whole(s3, prefix) is True


class _FailsWhileWriting(tsckpt.SavePlanner):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def resolve_data(self, write_item):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("injected failure while writing")
        return super().resolve_data(write_item)


def test_a_failed_save_removes_what_it_wrote_in_place(s3):
    import torch.distributed.checkpoint as dcp

    location = _loc(s3.endpoint, "failed-in-place")
    with pytest.raises(CheckpointException) as info:
        dcp.save(_state(0), storage_writer=tsckpt.TensorStoreWriter(location), planner=_FailsWhileWriting(),
                 no_dist=True)
    [(_, (error, _))] = info.value.failures.items()
    assert isinstance(error, SaveFailedError)
    assert str(error).splitlines()[0] == (f"save to s3://{BUCKET}/failed-in-place failed on rank 0: "
                                          f"RuntimeError: injected failure while writing")
    assert _keys(s3, "failed-in-place") == []  # the chunks written before the failure, and the claim


def test_loads_never_return_data_that_fails_its_checksum(s3):
    tsckpt.save(_state(5), _loc(s3.endpoint, "corrupt"), overwrite=True)
    refused = returned = 0
    with FaultProxy(s3.endpoint, rate=0.3, kinds=("corrupt",), seed=5) as proxy:
        for _ in range(8):
            back = _empty()
            try:
                tsckpt.load(back, _loc(proxy.endpoint, "corrupt"))
            except TsckptError as e:
                # A flipped byte fails a crc32c, or makes the root document unreadable JSON: refused either way.
                assert isinstance(e, ChecksumError) or "checksum" in str(e) or "crc32c" in str(e) \
                    or "is not valid JSON" in str(e), e
                refused += 1
                continue
            assert _same(back, _state(5))  # a load that returns, returns the saved bits
            returned += 1
        print(f"\n30% of answers with one byte flipped: {proxy.summary()}; {refused} loads refused, "
              f"{returned} returned the saved bits")
        assert refused > 0 and proxy.faulted > 0


def test_the_fault_proxy_forwards_untouched_when_told_to(s3):
    with FaultProxy(s3.endpoint, rate=0.0) as proxy:
        tsckpt.save(_state(9), _loc(proxy.endpoint, "clean"), overwrite=True)
        back = _empty()
        tsckpt.load(back, _loc(proxy.endpoint, "clean"))
        assert _same(back, _state(9)) and proxy.faulted == 0 and proxy.counts["requests"] > 10
    assert os.environ.get("AWS_ACCESS_KEY_ID")  # moto needs some credentials, any will do
