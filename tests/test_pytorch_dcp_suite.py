"""The PyTorch-suite runner swaps DCP's storage classes everywhere and reports what it saw."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

RUNNER = Path(__file__).resolve().parent.parent / "tools" / "pytorch_dcp_suite.py"

# Stands in for one of PyTorch's test files: it imports the names the way they do.
FAKE_TESTS = '''
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystemReader


def _child(queue):
    import torch.distributed.checkpoint as dcp
    queue.put(dcp.FileSystemWriter.__module__)


def test_writer_and_reader_are_tsckpts():
    assert FileSystemWriter.__module__.startswith("tsckpt")
    assert FileSystemReader.__module__.startswith("tsckpt")


def test_spawned_ranks_see_the_same_classes():
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    proc = ctx.Process(target=_child, args=(queue,))
    proc.start()
    proc.join()
    assert queue.get() == FileSystemWriter.__module__


def test_broken():
    raise ValueError("boom " + FileSystemWriter.__name__)
'''


def test_runner_swaps_in_every_process_and_reports_each_failure(tmp_path):
    tests = tmp_path / "dcp-tests"
    tests.mkdir()
    (tests / "test_fake.py").write_text(textwrap.dedent(FAKE_TESTS))
    out = subprocess.run(
        [sys.executable, str(RUNNER), str(tests), "test_fake.py", "test_missing.py", "--modes", "dcp,exact",
         "--workdir", str(tmp_path / "work"), "--timeout", "120", "--no-cpu", "--all"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr
    assert "skipping" in out.stderr and "test_missing.py" in out.stderr
    report = out.stdout
    assert "| test_fake.py | 3 | 1 | 2 |" in report, report
    dcp_section, tsckpt_section = report.split("### Failing under tsckpt (exact)")
    assert "test_writer_and_reader_are_tsckpts" in dcp_section.split("### Failing under DCP itself")[1]
    assert "`test_fake.py::test_broken` (DCP: failed): ValueError: boom TensorStoreWriter" in tsckpt_section
    assert "test_spawned_ranks_see_the_same_classes" not in report
