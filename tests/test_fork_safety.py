"""tsckpt's thread pools in a forked child: each process makes its own, so the child does not hang.

A pool used before a fork (a checkpoint opened before a DataLoader forks its
workers) is copied into the child with its parent's count of idle threads,
which do not exist there: the child's first task would wait forever. The parent runs in an interpreter of its own:
once TensorStore has run threads, it aborts any forked child that uses it, and
the test process has run TensorStore in other tests. So the parent uses the
pools directly (a chunk file written, a byte range read), never TensorStore.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

PARENT = """
    import os, sys, time
    import numpy as np
    import torch
    import tsckpt
    from tsckpt.storage import byte_writes, fetchers
    from tsckpt.storage.byte_writes import Blob

    root = sys.argv[1]
    # Both kinds of pool, used before the fork: a chunk file large enough for the write threads, and a read.
    writer = byte_writes.Files(root, sync=False, threads=4)
    writer.write("big", Blob(np.ones(2 << 20, np.uint8), checksum=False)).result()
    files = fetchers.LocalFiles(root)
    assert files.fetch("big", 0, 16).result().tolist() == [1] * 16

    state = {"w": torch.randn(1024, 512, generator=torch.Generator().manual_seed(0))}  # 2 MiB chunks
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            assert files.fetch("big", 16, 32).result(timeout=20).tolist() == [1] * 16
            writer.write("big2", Blob(np.ones(2 << 20, np.uint8), checksum=False)).result(20)
            tsckpt.save(state, os.path.join(root, "ck"), layout="plain")
            out = {"w": torch.zeros(1024, 512)}
            tsckpt.load(out, os.path.join(root, "ck"))
            code = 0 if torch.equal(out["w"], state["w"]) else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            print("child exit", os.waitstatus_to_exitcode(status))
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        print("child hung")
"""


def test_a_forked_child_saves_and_loads_after_the_parent_used_the_pools(tmp_path):
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(PARENT), str(tmp_path)], capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "child exit 0", proc.stdout + proc.stderr[-3000:]
