"""Arrays whose ``zarr.json`` or value blob was crafted or damaged: refused cleanly, never trusted.

Readers open every array with the data type, shape, chunk grid and codecs the
root document implies, so a ``zarr.json`` cannot make them allocate huge
chunks or decompress a bomb; a value blob must hold the bytes it declares, and
a blob that is damaged is told apart from one that needs unsafe unpickling.
"""

from __future__ import annotations

import io
import struct
import zipfile

import pytest
import torch

import tsckpt
from cli_run import one_line_error, run_cli
from damage import edit_array, rewrite_blob
from tsckpt.errors import DamagedValueError, TsckptError, UnsafeObjectError
from tsckpt.read.verify import verify


@pytest.fixture(params=["plain", "packed"])
def ckpt(tmp_path, request):
    path = tmp_path / "ckpt"
    tsckpt.save({"w": torch.arange(12.0).reshape(4, 3), "opaque": {1, 2, 3}, "step": 5}, path, layout=request.param)
    return path


def _sd():
    return {"w": torch.zeros(4, 3), "opaque": None, "step": None}


def _sd_saved():
    return {"w": torch.arange(12.0).reshape(4, 3)}


def _every_reader_refuses(ckpt, key, message):
    with pytest.raises(TsckptError, match=message):
        tsckpt.load(_sd(), ckpt)
    with pytest.raises(TsckptError, match=message):
        value = tsckpt.open(ckpt)[key]
        value.numpy() if isinstance(value, tsckpt.TensorHandle) else None
    report = verify(ckpt)
    assert [e.key for e in report.failed] == [key]
    return report.failed[0].problems


def _loads_ignore_it_and_verify_reports_it(ckpt, key):
    """A tensor's zarr.json is not read by loads of a version-2 checkpoint: the root document says
    how to decode every chunk, so a crafted one changes nothing there. verify still reports it."""
    sd = _sd()
    tsckpt.load(sd, ckpt, allow_pickle=True)
    assert torch.equal(sd[key], _sd_saved()[key])
    assert tsckpt.open(ckpt)[key].numpy().tobytes() == _sd_saved()[key].numpy().tobytes()
    report = verify(ckpt)
    assert [e.key for e in report.failed] == [key]
    return report.failed[0].problems


def test_compressor_swapped_into_a_tensor_zarr_json_is_refused(ckpt):
    codecs = [{"name": "bytes", "configuration": {"endian": "little"}},
              {"name": "zstd", "configuration": {"level": 22, "checksum": False}}]
    edit_array(ckpt, "w", codecs=codecs)
    problems = _loads_ignore_it_and_verify_reports_it(ckpt, "w")
    assert "codecs" in problems[0]


def test_huge_chunks_declared_in_zarr_json_are_refused_before_any_read(ckpt):
    edit_array(ckpt, "w", shape=[2**40, 3],
                chunk_grid={"name": "regular", "configuration": {"chunk_shape": [2**40, 3]}})
    problems = _loads_ignore_it_and_verify_reports_it(ckpt, "w")
    assert "shape" in problems[0] and "chunk_grid" in problems[0]


def _blob_loads_ignore_it_and_verify_reports_it(ckpt) -> tuple[str, ...]:
    """A value blob is read from the bytes stored for it, checked against their own crc32c; its ``zarr.json``
    (for other Zarr readers) is not consulted, so a crafted one changes nothing. verify reports it."""
    sd = _sd()
    tsckpt.load(sd, ckpt, allow_pickle=True)
    assert sd["opaque"] == {1, 2, 3}
    assert tsckpt.open(ckpt, allow_pickle=True)["opaque"] == {1, 2, 3}
    report = verify(ckpt)
    assert [e.key for e in report.failed] == ["opaque"]
    return report.failed[0].problems


def test_blob_declaring_a_terabyte_is_never_allocated(ckpt):
    edit_array(ckpt, "opaque", shape=[2**40],
                chunk_grid={"name": "regular", "configuration": {"chunk_shape": [2**40]}})
    # Before blobs were checked this aborted the process (std::bad_alloc): run the CLI in its own.
    done = run_cli("show", str(ckpt), "opaque", "--allow-pickle")
    assert done.returncode == 0 and "{1, 2, 3}" in done.stdout, done
    problems = _blob_loads_ignore_it_and_verify_reports_it(ckpt)
    assert "holds fewer bytes than the 1099511627776 its zarr.json declares" in problems[0]


def test_compressed_blob_declared_in_zarr_json_is_ignored(ckpt):
    edit_array(ckpt, "opaque", codecs=[{"name": "bytes"}, {"name": "zstd", "configuration": {"level": 3}},
                                         {"name": "crc32c"}])
    problems = _blob_loads_ignore_it_and_verify_reports_it(ckpt)
    assert "codecs" in problems[0]


@pytest.mark.parametrize("change", [{"fill_value": 1.0}, {"dimension_names": ["x", "y"]},
                                    {"storage_transformers": [{"name": "x"}]}])
def test_verify_compares_the_whole_zarr_json(ckpt, change):
    edit_array(ckpt, "w", **change)
    report = verify(ckpt)
    assert [e.key for e in report.failed] == ["w"]
    assert next(iter(change)) in report.failed[0].problems[0]


def test_verify_ignores_the_informative_attributes(ckpt):
    edit_array(ckpt, "w", attributes={"note": "edited by hand"})
    assert verify(ckpt).ok


# --- value blobs: damage is not "unsafe" ------------------------------------------------------


def _saved(value) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _flip_inside_the_pickle(blob: bytes) -> bytes:
    archive = zipfile.ZipFile(io.BytesIO(blob))
    member = next(i for i in archive.infolist() if i.filename.endswith("/data.pkl"))
    name_len, extra_len = struct.unpack("<HH", blob[member.header_offset + 26:member.header_offset + 30])
    start = member.header_offset + 30 + name_len + extra_len
    out = bytearray(blob)
    out[start + member.file_size // 2] ^= 0x01
    return bytes(out)


DAMAGE = {
    "truncated": (lambda b: b[: len(b) // 2], "not a readable zip archive"),
    "cut before its end": (lambda b: b[:-10], "not a readable zip archive"),
    "empty": (lambda b: b"", "not a torch.save archive"),
    "not an archive": (lambda b: bytes(range(256)) * 4, "not a torch.save archive"),
    "byte flipped in the pickle": (_flip_inside_the_pickle, "fails its zip CRC check"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_value_blob_is_reported_as_damage_not_as_unsafe(ckpt, case):
    damage, message = DAMAGE[case]
    rewrite_blob(ckpt, "opaque", damage(_saved({1, 2, 3})))
    for allow_pickle in (False, True):
        with pytest.raises(DamagedValueError, match=rf"'opaque'.*is damaged: .*{message}") as info:
            tsckpt.load(_sd(), ckpt, allow_pickle=allow_pickle)
        assert "allow_pickle" not in str(info.value) and "trust" not in str(info.value)
    with pytest.raises(DamagedValueError, match="is damaged"):
        tsckpt.open(ckpt)["opaque"]


class NotAllowed:
    """Any class outside torch's weights-only allow list."""


def test_sound_blob_that_needs_unpickling_still_asks_for_trust(ckpt):
    rewrite_blob(ckpt, "opaque", _saved(NotAllowed()))
    with pytest.raises(UnsafeObjectError, match=r"GLOBAL .*NotAllowed.*pass allow_pickle=True only if you trust"):
        tsckpt.load(_sd(), ckpt)
    sd = _sd()
    tsckpt.load(sd, ckpt, allow_pickle=True)
    assert isinstance(sd["opaque"], NotAllowed)
