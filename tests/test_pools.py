"""Thread pools belong to the writer or fetcher that uses them: as many threads as it was given, none after it."""

from __future__ import annotations

import threading

import numpy as np
import torch

import tsckpt
from tsckpt.storage import byte_writes, fetchers
from tsckpt.storage.byte_writes import Blob
from tsckpt.storage.store import Store


def _threads(prefix: str, but: frozenset[threading.Thread] = frozenset()) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix) and t not in but]


def _ended(prefix: str, but: frozenset[threading.Thread] = frozenset()) -> bool:
    """Whether every thread named ``prefix...`` that is not in ``but`` (those of objects earlier tests left to the
    collector) has ended."""
    for t in _threads(prefix, but):
        t.join(30)
    return not _threads(prefix, but)


def test_a_file_writer_writes_on_its_own_threads_as_many_as_it_was_given(tmp_path):
    writer = byte_writes.Files(str(tmp_path), sync=False, threads=2)
    gate = threading.Barrier(3)
    seen: list[str] = []

    def emit(value, write):  # every write waits until two are running at once: the pool has two threads
        seen.append(threading.current_thread().name)
        if len(seen) <= 2:
            gate.wait(30)
        write(memoryview(value.payload))

    big = Blob(np.zeros(byte_writes.INLINE_BYTES, np.uint8), checksum=False)
    futures = [writer.write(f"c{k}", big, lambda w: emit(big, w)) for k in range(6)]
    gate.wait(30)
    for f in futures:
        f.result()
    assert len(set(seen)) == 2 and all(name.startswith("tsckpt-file-write") for name in seen)
    writer.finish()
    assert _ended("tsckpt-file-write")


def test_local_reads_run_on_the_fetchers_threads_and_end_with_it(tmp_path):
    (tmp_path / "f").write_bytes(bytes(range(256)) * 64)
    before = frozenset(threading.enumerate())
    files = fetchers.LocalFiles(str(tmp_path), threads=3)
    reads = [files.fetch("f", k, k + 16) for k in range(0, 4096, 16)]
    assert [bytes(r.result()) for r in reads[:2]] == [bytes(range(16)), bytes(range(16, 32))]
    assert 1 <= len(_threads("tsckpt-read", before)) <= 3
    files.close()
    assert _ended("tsckpt-read", before)


def test_a_store_carries_its_io_concurrency(tmp_path):
    store = Store.open(str(tmp_path / "ck"), io_concurrency=8)
    assert store.io_concurrency == 8 and store.context["file_io_concurrency"].to_json() == {"limit": 8}


def test_no_thread_of_tsckpt_outlives_a_save_or_a_load(tmp_path):
    before = frozenset(threading.enumerate())
    state = {"w": torch.randn(1024, 512), "step": 3}  # 2 MiB chunks: written on the writer's threads
    for layout in ("plain", "packed"):
        path = str(tmp_path / layout)
        tsckpt.save(state, path, layout=layout, thread_count=2)
        out = {"w": torch.zeros(1024, 512), "step": 0}
        tsckpt.load(out, path)
        assert torch.equal(out["w"], state["w"])
        assert _ended("tsckpt-", before), [t.name for t in _threads("tsckpt-", before)]
