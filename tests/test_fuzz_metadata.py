"""Mutated metadata documents are either accepted consistently or refused with a TsckptError.

Starts from real documents (a saved checkpoint's, and one with every placement
kind) and applies random structural mutations with hypothesis; nothing but a
TsckptError may ever escape ``CheckpointMetadata.from_dict`` or
``commit.read_metadata``. End to end, the root ``zarr.json`` of a real saved
checkpoint is mutated (field values and types, truncation, byte flips) and the
checkpoint read through ``tsckpt.open`` and a one-process ``tsckpt.load``:
every outcome is a correct read or a TsckptError. Set ``TSCKPT_FUZZ_EXAMPLES``
for a longer run; the number of cases run is printed in the test summary.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from pathlib import Path
from typing import NamedTuple

import pytest
import tensorstore as ts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tsckpt.commit import protocol as commit
from tsckpt.format import writers
from tsckpt.format.zarr_json import group_metadata
from tsckpt.errors import TsckptError
from tsckpt.format.metadata import (
    CheckpointMetadata,
    DTensorPlacement,
    Mesh,
    ObjectEntry,
    ReplicatedPlacement,
    ShardedTensorPlacement,
    TensorEntry,
)

EXAMPLES = int(os.environ.get("TSCKPT_FUZZ_EXAMPLES", "400"))
RUNS = {"from_dict": 0, "read_metadata": 0, "accepted": 0,
        "end_to_end": 0, "end_to_end_refused": 0, "end_to_end_read": 0, "end_to_end_loaded": 0}


def _placed_document() -> dict:
    mesh = Mesh(shape=(2, 2), dim_names=("dp", "tp"), device_type="cpu", ranks=(0, 1, 2, 3))
    w = TensorEntry(("model", "w"), "model/w", (8, 6), "bfloat16", (4, 3), (2, 3),
                    DTensorPlacement(0, ({"type": "shard", "dim": 0}, {"type": "shard", "dim": 1})),
                    writers=writers.encode([0, 1, 2, 3]))
    st_ = TensorEntry(("st",), "st", (6, 2), "float32", (3, 2), None,
                      ShardedTensorPlacement((((0, 0), (3, 2), "rank:0/cpu"), ((3, 0), (3, 2), "rank:1/cpu"))),
                      writers=writers.encode([0, 1]))
    step = TensorEntry(("step",), "step", (), "int64", (), None, ReplicatedPlacement(), writers=writers.encode([0]))
    objs = {"lr": ObjectEntry(("lr",), "json", value={"$tuple": [0.9, {"$float": "nan"}]}),
            "blob": ObjectEntry(("blob",), "torch", path="blob", writer=3)}
    md = CheckpointMetadata(world_size=4, tensors={"model.w": w, "st": st_, "step": step}, objects=objs,
                            meshes=(mesh,), torch_version="2.13.0", tsckpt_version="0.1.0", extra={"save_id": "x"})
    return md.to_dict()


@pytest.fixture(scope="module", autouse=True)
def _report_counts(request):
    yield
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print("\nfuzz cases run: " + ", ".join(f"{k} {v}" for k, v in RUNS.items()))


@pytest.fixture(scope="module")
def documents(tmp_path_factory) -> list[dict]:
    import torch

    import tsckpt

    ckpt = tmp_path_factory.mktemp("fuzz") / "ckpt"
    tsckpt.save({"model": {"a": torch.ones(3, 2), "b": torch.zeros(4, dtype=torch.bfloat16)},
                 "opt": {"step": torch.tensor(1), "groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]},
                 "odd": {1, 2}}, ckpt)
    saved = json.loads((ckpt / "zarr.json").read_text())["attributes"]["tsckpt"]
    return [saved, _placed_document()]


json_leaf = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
             | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=6)
             | st.sampled_from(["../x", "/abs", "", "..", "float128", "zarr.json", "%2E%2E", "a\\b", "c/0"]))
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
HOSTILE_INTS = [-1, 0, 1, 2**31, 2**63, 10**30, -(10**30)]


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


def _mutate(data, doc):
    path = data.draw(st.sampled_from(list(_paths(doc))))
    if not path:
        return data.draw(json_value)
    parent = doc
    for p in path[:-1]:
        parent = parent[p]
    key, old = path[-1], parent[path[-1]]
    op = data.draw(st.sampled_from(["delete", "replace", "int", "retype", "duplicate", "empty"]))
    if op == "delete":
        del parent[key]
    elif op == "replace":
        parent[key] = data.draw(json_value)
    elif op == "int":
        parent[key] = data.draw(st.sampled_from(HOSTILE_INTS))
    elif op == "retype":
        parent[key] = ([old] if not isinstance(old, list) else {"0": old[0]} if old else {}) \
            if data.draw(st.booleans()) else (str(old) if not isinstance(old, str) else 1.5)
    elif op == "duplicate" and isinstance(old, list) and old:
        old.append(copy.deepcopy(old[data.draw(st.integers(0, len(old) - 1))]))
    elif op == "duplicate" and isinstance(old, dict) and old:
        src = data.draw(st.sampled_from(sorted(old)))
        old[src + data.draw(st.sampled_from(["_", ".", "/x"]))] = copy.deepcopy(old[src])
    else:
        parent[key] = type(old)() if isinstance(old, (list, dict, str)) else None
    return doc


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(data=st.data())
def test_from_dict_raises_only_tsckpt_errors(documents, data):
    doc = copy.deepcopy(data.draw(st.sampled_from(documents)))
    for _ in range(data.draw(st.integers(1, 3))):
        doc = _mutate(data, doc)
    RUNS["from_dict"] += 1
    try:
        md = CheckpointMetadata.from_dict(doc)
    except TsckptError:
        return
    # Whatever is accepted must survive its own round trip unchanged. Compared as canonical
    # JSON: a value may be NaN (tagged "nan"), and NaN never equals itself.
    RUNS["accepted"] += 1
    back = CheckpointMetadata.from_dict(json.loads(json.dumps(md.to_dict())))
    assert json.dumps(back.to_dict(), sort_keys=True) == json.dumps(md.to_dict(), sort_keys=True)


@settings(max_examples=EXAMPLES // 2, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(data=st.data())
def test_read_metadata_raises_only_tsckpt_errors(documents, data):
    doc = copy.deepcopy(data.draw(st.sampled_from(documents)))
    raw = bytearray(json.dumps(group_metadata({commit.ATTRIBUTE: doc})).encode())
    how = data.draw(st.sampled_from(["flip", "truncate", "insert", "mutate"]))
    if how == "mutate":
        raw = bytearray(json.dumps(_stamped(_mutate(data, group_metadata({commit.ATTRIBUTE: doc})))).encode())
    elif how == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    else:
        for _ in range(data.draw(st.integers(1, 4))):
            at = data.draw(st.integers(0, len(raw) - 1))
            byte = data.draw(st.integers(0, 255))
            if how == "flip":
                raw[at] = byte
            else:
                raw.insert(at, byte)
    kv = ts.KvStore.open({"driver": "memory"}).result()
    kv.write(commit.ROOT, bytes(raw)).result()
    RUNS["read_metadata"] += 1
    try:
        commit.read_metadata(kv, "memory://fuzz")
    except TsckptError:
        pass


def _stamped(root):
    """The root with its document's checksum recomputed, as a hostile writer would: validation must hold alone."""
    attrs = root.get("attributes") if isinstance(root, dict) else None
    if isinstance(attrs, dict) and isinstance(attrs.get(commit.ATTRIBUTE), dict):
        try:
            attrs[commit.CHECKSUM_ATTRIBUTE] = commit.document_checksum(attrs[commit.ATTRIBUTE])
        except (TypeError, ValueError, RecursionError):
            pass
    return root


# --- end to end: a real checkpoint whose root document is mutated ----------------------------


def _state_dict():
    import torch

    return {"model": {"a": torch.arange(12.0).reshape(3, 4), "b": torch.arange(6, dtype=torch.bfloat16),
                      "big": torch.arange(256, dtype=torch.int32).reshape(16, 16)},
            "opt": {"step": torch.tensor(3), "groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]},
            "odd": {1, 2}}


class Saved(NamedTuple):
    """A real checkpoint (with inner chunks for ``model.big``), its root bytes and its data by array path."""

    ckpt: Path
    root: bytes
    by_path: dict

    def __repr__(self) -> str:  # hypothesis prints it with every falsifying example
        return f"Saved({self.ckpt})"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Saved:
    import shutil

    import tsckpt

    ckpt = tmp_path_factory.mktemp("fuzz-e2e") / "ckpt"
    tsckpt.save(_state_dict(), ckpt, inner_chunk_bytes=256)
    root = (ckpt / "zarr.json").read_bytes()
    md = CheckpointMetadata.from_dict(json.loads(root)["attributes"]["tsckpt"])
    ck = tsckpt.open(ckpt)
    by_path = {e.path: ck[k].numpy() for k, e in md.tensors.items()}
    work = tmp_path_factory.mktemp("fuzz-e2e-work") / "ckpt"
    shutil.copytree(ckpt, work)
    return Saved(work, root, by_path)


def _mutated_root(data, root: bytes) -> bytes:
    how = data.draw(st.sampled_from(["mutate", "mutate", "mutate", "flip", "truncate", "insert"]))
    if how == "mutate":
        doc = json.loads(root)
        for _ in range(data.draw(st.integers(1, 3))):
            doc["attributes"]["tsckpt"] = _mutate(data, doc["attributes"]["tsckpt"])
        return json.dumps(_stamped(doc)).encode()
    raw = bytearray(root)
    if how == "truncate":
        return bytes(raw[: data.draw(st.integers(0, len(raw)))])
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw) - 1))
        if how == "flip":
            raw[at] ^= 1 << data.draw(st.integers(0, 7))
        else:
            raw.insert(at, data.draw(st.integers(0, 255)))
    return bytes(raw)


def _read_everything(ckpt, by_path) -> None:
    """Open and read every entry; whatever reads must be the saved data of the array it names."""
    import tsckpt

    ck = tsckpt.open(ckpt)
    for key in ck:
        value = ck[key]
        if key in ck.tensors:
            got = value.numpy()
            want = by_path[ck.metadata.tensors[key].path]
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), key
    RUNS["end_to_end_read"] += 1


def _load_everything(ckpt, by_path) -> None:
    import torch

    import tsckpt
    from tsckpt.format import dtypes

    sd = _state_dict()
    tensors = [(("model", "a"), sd["model"]), (("model", "b"), sd["model"]), (("model", "big"), sd["model"])]
    for _, parent in tensors:
        for k, t in parent.items():
            parent[k] = torch.zeros_like(t)
    tsckpt.load(sd, ckpt)
    for (group, name), parent in tensors:
        got = dtypes.tensor_as_numpy(parent[name])
        assert got.tobytes() == by_path[f"{group}/{name}"].tobytes(), name
    RUNS["end_to_end_loaded"] += 1


@settings(max_examples=max(EXAMPLES // 4, 20), deadline=None, suppress_health_check=list(HealthCheck),
          database=None)
@given(data=st.data())
def test_open_and_load_of_a_mutated_root_document_raise_only_tsckpt_errors(saved, data):
    ckpt, root, by_path = saved
    (ckpt / commit.ROOT).write_bytes(_mutated_root(data, root))
    RUNS["end_to_end"] += 1
    for step in (_read_everything, _load_everything):
        try:
            step(ckpt, by_path)
        except TsckptError:
            RUNS["end_to_end_refused"] += 1
