"""Checkpoints cannot run code, and hostile keys or metadata cannot reach outside the directory."""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tsckpt
from damage import delete_prefix, rewrite_blob
from cli_run import one_line_error, run_cli
from tsckpt.commit import protocol as commit
from tsckpt.errors import MetadataError, TsckptError, UnsafeObjectError
from tsckpt.format.metadata import MAX_DOCUMENT_BYTES
from tsckpt.read.verify import verify

HOSTILE_KEYS = ["../escape", "../../../tmp/x", "/abs/path", "a/b/../../c", "..", ".", "zarr.json", "c",
                "__pycache__", ".hidden", "back\\slash", "%2E%2E", "%", "sp ace\ttab\nnl", "ключ🔑", "a\x00b"]


class _Marker:
    """Unpickling this object runs a shell command that creates a file."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.path)}",))


@pytest.fixture
def evil_ckpt(tmp_path):
    ckpt = tmp_path / "ckpt"
    tsckpt.save({"w": torch.arange(4.0), "opaque": {1, 2, 3}}, ckpt)  # a set is stored as a torch blob
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save(_Marker(str(marker)), buf)
    rewrite_blob(ckpt, "opaque", buf.getvalue())
    return ckpt, marker


def test_crafted_pickle_does_not_run_on_load(evil_ckpt):
    ckpt, marker = evil_ckpt
    sd = {"w": torch.zeros(4), "opaque": None}
    with pytest.raises(UnsafeObjectError, match=r"'opaque'.*GLOBAL (posix|os)\.system"):
        tsckpt.load(sd, ckpt)
    assert not marker.exists()
    with pytest.raises(BaseException) as info:  # DCP wraps the rank's error in its CheckpointException
        dcp.load(sd, storage_reader=tsckpt.TensorStoreReader(ckpt), planner=tsckpt.LoadPlanner())
    assert "UnsafeObjectError" in str(info.value) or isinstance(info.value, UnsafeObjectError)
    assert not marker.exists()
    report = verify(ckpt)
    assert report.ok and not marker.exists()  # verifying reads bytes, never unpickles


def test_dcps_default_load_planner_never_unpickles_the_stored_blob(evil_ckpt):
    # DCP's DefaultLoadPlanner.load_bytes calls torch.load(weights_only=False) on what the
    # reader hands it: the reader must restore values safely first, and refuse this one.
    ckpt, marker = evil_ckpt
    with pytest.raises(BaseException) as info:
        dcp.load({"w": torch.zeros(4), "opaque": None}, storage_reader=tsckpt.TensorStoreReader(ckpt))
    assert "UnsafeObjectError" in str(info.value) or isinstance(info.value, UnsafeObjectError)
    assert not marker.exists()


def test_allow_pickle_does_run_it(evil_ckpt):
    ckpt, marker = evil_ckpt
    sd = {"w": torch.zeros(4), "opaque": None}
    tsckpt.load(sd, ckpt, allow_pickle=True)
    assert marker.exists()  # proves the payload is live, so the test above can fail


def test_hostile_keys_stay_inside_and_round_trip(tmp_path):
    ckpt = tmp_path / "inner" / "ckpt"
    sd = {k: torch.full((2,), float(i)) for i, k in enumerate(HOSTILE_KEYS)}
    sd["values"] = {k: i for i, k in enumerate(HOSTILE_KEYS)}
    sd["nested"] = {"..": {"..": torch.ones(3)}, "/": {"etc": torch.zeros(1)}}
    tsckpt.save(sd, ckpt)
    outside = [p for p in tmp_path.rglob("*") if ckpt not in p.parents and p not in (ckpt, ckpt.parent)]
    assert outside == []
    for p in ckpt.rglob("*"):
        assert p.resolve().is_relative_to(ckpt.resolve()), p
        assert p.name not in ("..", ".") and not p.name.startswith("__")
    back = {k: torch.zeros(2) for k in HOSTILE_KEYS}
    back["values"] = {k: None for k in HOSTILE_KEYS}
    back["nested"] = {"..": {"..": torch.zeros(3)}, "/": {"etc": torch.ones(1)}}
    tsckpt.load(back, ckpt)
    for i, k in enumerate(HOSTILE_KEYS):
        assert torch.equal(back[k], torch.full((2,), float(i))), k
    assert back["values"] == {k: i for i, k in enumerate(HOSTILE_KEYS)}
    assert torch.equal(back["nested"][".."][".."], torch.ones(3))
    assert torch.equal(back["nested"]["/"]["etc"], torch.zeros(1))


@pytest.fixture(scope="module")
def good_ckpt(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("good") / "ckpt"
    tsckpt.save({"model": {"w": torch.randn(4, 3)}, "blob": {1, 2}, "lr": 0.5}, ckpt, layout="packed")
    return ckpt


def _edit(ckpt, tmp_path, fn):
    copy = tmp_path / "edited"
    shutil.copytree(ckpt, copy)
    root = json.loads((copy / "zarr.json").read_text())
    out = fn(root["attributes"]["tsckpt"], copy)
    # A hostile writer can recompute the document's checksum: validation must hold on its own.
    edited = root if out is None else _parsed(out)
    if edited is not None:
        try:
            edited["attributes"]["tsckpt_crc32c"] = commit.document_checksum(edited["attributes"]["tsckpt"])
            out = json.dumps(edited)
        except (ValueError, TypeError, RecursionError):  # NaN and the like: refused before any checksum
            pass
    (copy / "zarr.json").write_text(out)
    return copy


def _parsed(text):
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        return None
    attrs = doc.get("attributes") if isinstance(doc, dict) else None
    return doc if isinstance(attrs, dict) and isinstance(attrs.get("tsckpt"), dict) else None


def _w(md):
    return md["tensors"]["model.w"]


BROKEN = {
    "dotdot tensor path": (lambda md, c: _w(md).update(path="../../outside"), "not a safe relative path"),
    "absolute tensor path": (lambda md, c: _w(md).update(path="/etc"), "not a safe relative path"),
    "path not from key": (lambda md, c: _w(md).update(path="model/other"), "does not match key path"),
    "dotdot key path": (lambda md, c: _w(md).update(key_path=["..", "w"]), "does not match key path"),
    "dotdot object path": (lambda md, c: md["objects"]["blob"].update(path="../blob"), "not a safe relative path"),
    "negative size": (lambda md, c: _w(md).update(shape=[-4, 3]), "integers >= 0"),
    "wrong shape": (lambda md, c: _w(md).update(shape=[2, 3]), "larger than shape"),
    "index outside": (lambda md, c: md["data_files"].update(index=["../outside", 0, 10]), "not a safe relative path"),
    "data file outside": (lambda md, c: md["data_files"]["ranks"][0].update(files=[["/etc/passwd", 1]]),
                          "not a safe relative path"),
    "ranks of files": (lambda md, c: md["data_files"].update(ranks=[]), "lists 0 ranks, world_size is 1"),
    "no index": (lambda md, c: md["data_files"].update(index=None), "names no index"),
    "unknown dtype": (lambda md, c: _w(md).update(dtype="float128"), "unknown data type 'float128'"),
    "zero chunk": (lambda md, c: _w(md).update(chunk_shape=[0, 3]), "integers >= 1"),
    "chunk rank": (lambda md, c: _w(md).update(chunk_shape=[4]), "wrong rank"),
    "a table beside the chunks": (lambda md, c: _w(md).update(checksums="AAAAAA=="), "holds per-chunk tables"),
    "string size": (lambda md, c: _w(md).update(shape=["4", 3]), "list of integers"),
    "bool size": (lambda md, c: _w(md).update(shape=[True, 3]), "list of integers"),
    "tensors list": (lambda md, c: md.update(tensors=[]), "wrong type"),
    "future version": (lambda md, c: md.update(version=99), "not supported"),
    "unknown placement": (lambda md, c: _w(md).update(placement={"kind": "alien"}), "unknown placement kind"),
    "unknown encoding": (lambda md, c: md["objects"]["lr"].update(encoding="pickle"), "unknown encoding"),
    "malformed json": (lambda md, c: '{"zarr_format": 3, "attributes": {"tsckpt": {', "not valid JSON"),
    "not utf-8": (lambda md, c: b"\xff\xfe{}".decode("latin-1"), "not valid JSON"),
    "deep nesting": (lambda md, c: "[" * 100_000 + "]" * 100_000, "not valid JSON"),
    "metadata not an object": (lambda md, c: json.dumps({"attributes": {"tsckpt": [1]}}), "expected a JSON object"),
    "chunk larger than shape": (lambda md, c: _w(md).update(chunk_shape=[8, 3]), "larger than shape"),
    "inner chunk larger than chunk": (lambda md, c: _w(md).update(inner_chunk_shape=[8, 3]),
                                      "inner_chunk_shape \\[8, 3\\] is larger than chunk_shape"),
    "inner chunk does not divide": (lambda md, c: _w(md).update(inner_chunk_shape=[3, 3]), "does not divide"),
    "33 dimensions": (lambda md, c: _w(md).update(shape=[1] * 33, chunk_shape=[1] * 33), "at most 32"),
    "2**63 bytes": (lambda md, c: _w(md).update(shape=[2**61, 3]), "more than 2\\*\\*63 bytes"),
    "no ranks": (lambda md, c: md.update(world_size=0), "world_size 0"),
    "json value missing": (lambda md, c: md["objects"]["lr"].pop("value") and None, "missing field 'value'"),
    "NaN literal": (lambda md, c: json.dumps({"attributes": {"tsckpt": md}}).replace("0.5", "NaN"),
                    "NaN is not valid JSON"),
    "shard outside shape": (lambda md, c: _w(md).update(placement={"kind": "sharded_tensor", "shards": [
        {"offsets": [2, 0], "sizes": [4, 3], "placement": "rank:0/cpu"}]}), "shard at \\[2, 0\\]"),
    "lone surrogate in key": (lambda md, c: json.dumps({"attributes": {"tsckpt": md}}).replace(
        '"key_path": ["model", "w"]', '"key_path": ["model", "\\ud800"]'), "not valid Unicode"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_metadata_is_refused_clearly(good_ckpt, tmp_path, case):
    fn, message = BROKEN[case]
    if case == "not utf-8":
        copy = _edit(good_ckpt, tmp_path, lambda md, c: None)
        (copy / "zarr.json").write_bytes(b"\xff\xfe{}")
    else:
        copy = _edit(good_ckpt, tmp_path, fn)
    sd = {"model": {"w": torch.zeros(4, 3)}, "blob": None, "lr": None}
    with pytest.raises(MetadataError, match=message):
        tsckpt.load(sd, copy)
    assert not (tmp_path / "outside").exists()


def test_missing_array_is_refused_naming_the_tensor(good_ckpt, tmp_path):
    copy = _edit(good_ckpt, tmp_path, lambda md, c: None)
    delete_prefix(copy, "model/w")
    with pytest.raises(TsckptError, match=r"'model\.w'"):
        tsckpt.load({"model": {"w": torch.zeros(4, 3)}}, copy, allow_partial_load=True)


def test_array_swapped_through_symlink_is_not_followed_outside(good_ckpt, tmp_path):
    # A key path can only name escaped nodes under the root; the metadata path must equal it.
    copy = _edit(good_ckpt, tmp_path, lambda md, c: _w(md).update(key_path=["model", "../w"], path="model/../w"))
    with pytest.raises(MetadataError, match="not a safe relative path"):
        tsckpt.load({"model": {"w": torch.zeros(4, 3)}}, copy)


TAGGED = {
    "$dict holding a number": {"$dict": 5},
    "$float holding a word": {"$float": "abc"},
    "$float holding a finite number": {"$float": "1.5"},
    "$tuple holding a number": {"$tuple": 3},
    "$dict pair of three": {"$dict": [[1, 2, 3]]},
    "$dict with an object key": {"$dict": [[{"a": 1}, 2]]},
    "nested deep inside a list": [1, {"k": {"$tuple": [{"$dict": "x"}]}}],
}


@pytest.mark.parametrize("case", list(TAGGED))
def test_malformed_tagged_value_is_refused_naming_the_value_and_the_checkpoint(good_ckpt, tmp_path, case):
    copy = _edit(good_ckpt, tmp_path, lambda md, c: md["objects"]["lr"].update(value=TAGGED[case]))
    message = rf"{re.escape(str(copy))}/zarr\.json: object 'lr': value is not valid tagged JSON"
    with pytest.raises(MetadataError, match=message):
        tsckpt.open(copy)
    with pytest.raises(MetadataError, match=message):
        tsckpt.load({"model": {"w": torch.zeros(4, 3)}, "lr": None}, copy)
    with pytest.raises(BaseException) as info:  # DCP re-raises the reader's error inside its own exception
        dcp.load({"lr": None}, storage_reader=tsckpt.TensorStoreReader(copy), planner=tsckpt.LoadPlanner())
    assert "not valid tagged JSON" in str(info.value) and "'lr'" in str(info.value)


def test_malformed_tagged_value_is_one_line_from_the_cli(good_ckpt, tmp_path):
    copy = _edit(good_ckpt, tmp_path, lambda md, c: md["objects"]["lr"].update(value={"$dict": 5}))
    for args in (["show", str(copy), "lr"], ["info", str(copy)], ["ls", str(copy)]):
        assert f"{copy}/zarr.json: object 'lr': value is not valid tagged JSON" in one_line_error(run_cli(*args))


def test_root_document_over_the_size_cap_is_refused_before_it_is_read(good_ckpt, tmp_path):
    copy = _edit(good_ckpt, tmp_path, lambda md, c: None)
    # A sparse file: 300 MiB long, no disk used; a reader that read it whole would hold it all in memory.
    os.truncate(copy / "zarr.json", MAX_DOCUMENT_BYTES + (44 << 20))
    with pytest.raises(MetadataError, match=rf"zarr\.json is larger than {MAX_DOCUMENT_BYTES} bytes"):
        tsckpt.open(copy)
    with pytest.raises(MetadataError, match="larger than"):
        tsckpt.load({"model": {"w": torch.zeros(4, 3)}}, copy, allow_partial_load=True)


def test_an_index_that_names_a_file_outside_the_checkpoint_is_refused(tmp_path):
    # A packed index made to point a chunk at a file of the attacker's choosing: here a copy of the real data
    # file outside the checkpoint, so every check of the bytes themselves would pass.
    from damage import _index, _rewrite
    from tsckpt.format import ocdbt

    ckpt = tmp_path / "ckpt"
    tsckpt.save({"w": torch.arange(64.0).reshape(8, 8)}, ckpt, layout="packed")
    _, index = _index(ckpt)
    key, ref = next((k, v) for k, v in index.items() if isinstance(v, ocdbt.Ref))
    outside = tmp_path / "outside"
    shutil.copy(ckpt / ref.path, outside)
    _rewrite(ckpt, {**index, key: ocdbt.Ref(str(outside), ref.offset, ref.length)})
    with pytest.raises(MetadataError, match="not one of the checkpoint's data files"):
        tsckpt.load({"w": torch.zeros(8, 8)}, ckpt)
    assert not verify(ckpt).ok
