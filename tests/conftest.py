"""Fixtures shared by the whole suite, each started or built once per run.

* ``s3``: the run's one moto S3 server on 127.0.0.1. A module that uses it names
  its own bucket in a module-level ``BUCKET``, created on first use, so modules
  see only their own objects; the dummy AWS credentials are set for that
  module's tests (and the ranks they start) only.
* ``zoo4``, ``packed4``, ``zoo_ckpt``: the 4-rank zoo checkpoint (``zoo.py``)
  saved by real gloo ranks, plain, packed and in the default layout
  (``$TSCKPT_LAYOUT``), which is one of the other two, not a third save.

The checkpoints are shared read-only: a test that damages or edits one works on
a copy (``shutil.copytree``). Each is fingerprinted when saved and checked again
when the run ends, so a test that writes into one fails.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402

import dist  # noqa: E402
import zoo  # noqa: E402
from s3server import MotoServer, restore_credentials, set_credentials  # noqa: E402
from tsckpt.storage.layouts import default_layout  # noqa: E402

# A suite started in the background by a non-interactive shell inherits SIGINT ignored, and so would every
# process it starts (an ignored signal stays ignored across exec). The Ctrl-C tests need what a terminal
# gives: the interpreter's own handler, which children get back as the default disposition.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def moto_server():
    with MotoServer() as server:
        yield server


@pytest.fixture(scope="module")
def s3(moto_server, request):
    """The run's moto server, with the calling module's ``BUCKET`` created and dummy credentials set."""
    bucket = getattr(request.module, "BUCKET", None)
    if bucket is None:
        raise pytest.UsageError(f"{request.module.__name__} uses the s3 fixture without a module-level BUCKET")
    # Set before any rank is started: ranks take the environment of the call that starts them.
    previous = set_credentials()
    if bucket not in _BUCKETS:
        moto_server.create_bucket(bucket)
        _BUCKETS.add(bucket)
    yield moto_server
    restore_credentials(previous)


_BUCKETS: set[str] = set()


def fingerprint(path: str) -> str:
    """A digest of every file's name and bytes under ``path``."""
    digest = hashlib.sha256()
    for file in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(path)).encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


class SharedCheckpoints:
    """Checkpoints saved once per run and read by many tests; see the module docstring."""

    def __init__(self, base: Path):
        self.base = base
        self.paths: dict[str, str] = {}
        self.digests: dict[str, str] = {}

    def zoo(self, layout: str) -> str:
        """The 4-rank zoo saved in ``layout``, by 4 gloo ranks the first time it is asked for."""
        if layout not in self.paths:
            path = str(self.base / f"zoo-{layout}" / "ckpt")
            dist.run_ranks(4, zoo.save_zoo, path, layout)
            self.paths[layout], self.digests[path] = path, fingerprint(path)
        return self.paths[layout]

    def changed(self) -> list[str]:
        return [path for path, digest in self.digests.items() if fingerprint(path) != digest]


@pytest.fixture(scope="session")
def shared_checkpoints(tmp_path_factory):
    shared = SharedCheckpoints(tmp_path_factory.mktemp("shared"))
    yield shared
    changed = shared.changed()
    assert not changed, f"shared checkpoints written to by a test (copy them before editing): {changed}"


@pytest.fixture(scope="session")
def zoo4(shared_checkpoints) -> str:
    """The zoo saved by 4 ranks in the plain layout (one file per chunk)."""
    return shared_checkpoints.zoo("plain")


@pytest.fixture(scope="session")
def packed4(shared_checkpoints) -> str:
    """The zoo saved by 4 ranks in the packed layout: per-rank OCDBT databases joined at commit."""
    return shared_checkpoints.zoo("packed")


@pytest.fixture(scope="session")
def zoo_ckpt(shared_checkpoints) -> str:
    """The zoo saved by 4 ranks in the layout a save that names none gets (``$TSCKPT_LAYOUT``)."""
    return shared_checkpoints.zoo(default_layout())
