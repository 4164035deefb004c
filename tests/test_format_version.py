"""A checkpoint in another format version is refused in one line that names the release reading it.

Until 1.0 tsckpt reads only the version it writes (``docs/format.md``,
section 9). Each test saves a real checkpoint, rewrites its root document to
another version (with a valid ``tsckpt_crc32c``, so that the version is what
is refused), and reads it through every entry point.
"""

from __future__ import annotations

import json

import pytest
import torch
import zarr

import tsckpt
from cli_run import one_line_error, run_cli
from tsckpt.commit.protocol import document_checksum
from tsckpt.errors import MetadataError, UnsupportedVersionError
from tsckpt.format.versions import FORMAT_VERSION


def _state(step: int) -> dict:
    return {"w": torch.arange(24.0).reshape(4, 6) + step, "step": step}


def _as_version(path, version: int) -> None:
    root = json.loads((path / "zarr.json").read_text())
    document = root["attributes"]["tsckpt"]
    document["version"] = version
    root["attributes"]["tsckpt_crc32c"] = document_checksum(document)
    (path / "zarr.json").write_text(json.dumps(root))


def _refusals(path) -> list[str]:
    """The error of every way to read ``path``, each checked to be one line of the same class."""
    messages = []
    for read in (lambda: tsckpt.open(path), lambda: tsckpt.load({"w": torch.zeros(4, 6), "step": 0}, path),
                 lambda: tsckpt.verify(path), lambda: zarr.open_group(tsckpt.zarr_store(path), mode="r")):
        with pytest.raises(UnsupportedVersionError) as info:
            read()
        assert isinstance(info.value, MetadataError) and "\n" not in str(info.value)
        messages.append(str(info.value))
    return messages


@pytest.mark.parametrize("version", [1, 4])
@pytest.mark.parametrize("layout", ["plain", "packed"])
def test_an_older_version_names_the_release_that_reads_it(tmp_path, version, layout):
    path = tmp_path / "ckpt"
    tsckpt.save(_state(1), path, layout=layout)
    _as_version(path, version)
    for message in _refusals(path):
        assert message.startswith(f"{path}/zarr.json: format version {version} is not supported by this tsckpt "
                                  f"(it reads version {FORMAT_VERSION} only)"), message
        assert "tsckpt 0.1 reads it" in message and "tsckpt convert" in message
    line = one_line_error(run_cli("verify", str(path)))
    assert f"format version {version}" in line and "tsckpt 0.1 reads it" in line


def test_a_newer_version_asks_for_a_newer_tsckpt(tmp_path):
    path = tmp_path / "ckpt"
    tsckpt.save(_state(1), path)
    _as_version(path, FORMAT_VERSION + 1)
    for message in _refusals(path):
        assert f"format version {FORMAT_VERSION + 1} is not supported" in message
        assert message.endswith("a newer tsckpt reads it") and "0.1" not in message


def test_an_incremental_save_beside_an_older_version_writes_everything(tmp_path):
    tsckpt.save(_state(1), tmp_path / "step_1")
    _as_version(tmp_path / "step_1", 4)
    tsckpt.save(_state(2), tmp_path / "step_2", incremental=True)
    reuse = tsckpt.open(tmp_path / "step_2").metadata.reuse
    assert reuse is not None and reuse.chunks_reused == 0 and reuse.bytes_reused == 0
    assert reuse.note == "the base is in a format version this tsckpt does not read"
    back = {"w": torch.zeros(4, 6), "step": 0}
    tsckpt.load(back, tmp_path / "step_2")
    assert torch.equal(back["w"], _state(2)["w"]) and back["step"] == 2
