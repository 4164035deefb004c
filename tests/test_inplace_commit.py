"""Saves on stores without rename (memory://, S3 on a real moto server): claims, conditional commits.

These stores are written in place. A claim object, written only if nobody
holds one, keeps a second save out while one runs (with overwrite=True too,
unless every key the running save writes carries its save id); the root
document is written only if it is still absent; overwriting un-commits the old
checkpoint first, which docs/publication.md states is not crash-safe there.
"""

from __future__ import annotations

import json

import pytest
import tensorstore as ts
import torch

import tsckpt
from tsckpt.errors import CheckpointExistsError, ConcurrentSaveError, ForeignContentError, IncompleteCheckpointError
from tsckpt.commit.states import CLAIM
from tsckpt.storage.context import make_context, open_kvstore
from tsckpt.storage.location import parse_location

BUCKET = "tsckpt-inplace"  # this module's bucket on the run's moto server (the s3 fixture, conftest.py)
_COUNTER = iter(range(10**6))


@pytest.fixture(params=["memory", "s3", "s3-conditional-put"])
def location(request):
    """A fresh location on each kind of in-place store.

    ``s3-conditional-put`` asks TensorStore to send If-Match / If-None-Match with
    each conditional PUT (it does so by itself only for AWS endpoints); without it,
    TensorStore checks the condition with a HEAD request just before the PUT.
    """
    name = f"inplace/run{next(_COUNTER)}"
    if request.param == "memory":
        return f"memory://{name}"
    server = request.getfixturevalue("s3")
    loc = server.location(BUCKET, name)
    if request.param == "s3-conditional-put":
        loc["use_conditional_write"] = True
    return loc


def _kv(location):
    loc = parse_location(location)
    return open_kvstore(loc, make_context(location=loc))


def _state(v: float) -> dict:
    return {"w": torch.full((4, 3), float(v)), "step": int(v)}


def _loaded(location) -> float:
    sd = {"w": torch.zeros(4, 3), "step": None}
    tsckpt.load(sd, location)
    assert torch.equal(sd["w"], torch.full((4, 3), float(sd["step"])))
    return sd["step"]


def test_second_save_is_refused_while_the_first_holds_the_location(location):
    first = tsckpt.CheckpointBuilder(location)
    first.add_tensor("w", torch.full((4, 3), 1.0))
    first.add_object("step", 1)
    with pytest.raises(ConcurrentSaveError, match=f"save {first.save_id} .*has not finished"):
        tsckpt.save(_state(2), location)
    first.commit()
    assert _loaded(location) == 1
    assert tsckpt.leftovers(location) == []  # the claim went with the commit


@pytest.mark.parametrize("layout", ["plain", "packed"])
def test_an_overwriting_save_does_not_take_over_a_claim_it_cannot_fence(location, layout):
    # A CheckpointBuilder's claim does not say its keys carry its save id: its writes still
    # on their way could land in the new checkpoint, so overwrite=True does not take over.
    first = tsckpt.CheckpointBuilder(location, layout=layout)
    first.add_tensor("w", torch.full((4, 3), 1.0))
    first.add_object("step", 1)
    with pytest.raises(ConcurrentSaveError, match=f"save {first.save_id} .*overwrite=True cannot take the "
                                                  f"location over.*tsckpt clean --force"):
        tsckpt.save(_state(2), location, overwrite=True, layout=layout)
    first.commit()
    assert _loaded(location) == 1


def test_committed_checkpoint_and_foreign_data_are_refused(location):
    tsckpt.save(_state(1), location)
    with pytest.raises(CheckpointExistsError, match="Checkpoint already exists"):
        tsckpt.save(_state(2), location)
    assert _loaded(location) == 1
    kv = _kv(location)
    kv.write("zarr.json", json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}).encode()).result()
    for overwrite in (False, True):
        with pytest.raises(ForeignContentError, match="Zarr group that tsckpt did not write"):
            tsckpt.save(_state(2), location, overwrite=overwrite)
    assert _kv(location).read("zarr.json").result().value == json.dumps(
        {"zarr_format": 3, "node_type": "group", "attributes": {}}).encode()


def test_a_dead_save_is_reported_refused_and_cleaned(location):
    dead = tsckpt.CheckpointBuilder(location)
    dead.add_tensor(("gone", "x"), torch.ones(5))
    dead.flush()
    del dead  # what a killed process leaves: its claim and its chunks, no commit
    [left] = tsckpt.leftovers(location)
    assert left.live is None and CLAIM in left.path
    with pytest.raises(ConcurrentSaveError, match="tsckpt clean --force"):
        tsckpt.save(_state(3), location)
    assert tsckpt.clean(location) == []  # a claim cannot be told from a running save's
    assert len(tsckpt.clean(location, force=True)) == 1
    assert list(_kv(location).list().result()) == []  # the dead save's chunks went too
    tsckpt.save(_state(3), location)
    assert _loaded(location) == 3


def test_overwriting_a_dead_save_removes_its_leftovers(location):
    tsckpt.save(_state(1), location)
    dead = tsckpt.CheckpointBuilder(location, overwrite=True)
    dead.add_tensor(("gone", "x"), torch.ones(5))
    dead.flush()
    del dead
    with pytest.raises(ConcurrentSaveError, match="overwrite=True cannot take the location over"):
        tsckpt.save(_state(4), location, overwrite=True)
    assert len(tsckpt.clean(location, force=True)) == 1
    tsckpt.save(_state(4), location, overwrite=True)
    assert _loaded(location) == 4
    keys = [k.decode() for k in _kv(location).list().result()]
    assert not any(k.startswith("gone/") for k in keys) and CLAIM not in keys


def test_overwrite_takes_over_a_dead_packed_save_and_removes_its_data_files(location):
    """A claim saying every key of its save carries the save's id (packed) is taken over by overwrite=True."""
    dead_id = "d" * 32
    kv = _kv(location)
    kv.write(f"d/{dead_id}-0.0", b"\0" * 64).result()
    kv.write(CLAIM, json.dumps({"save_id": dead_id, "host": "h", "pid": 1, "started": "2020-01-01T00:00:00+00:00",
                                "keys": "own"}).encode()).result()
    with pytest.raises(ConcurrentSaveError, match="pass overwrite=True"):
        tsckpt.save(_state(5), location, layout="packed")
    tsckpt.save(_state(5), location, overwrite=True, layout="packed")
    assert _loaded(location) == 5
    keys = [k.decode() for k in _kv(location).list().result()]
    assert not any(dead_id in k for k in keys) and CLAIM not in keys


@pytest.mark.parametrize("layout", ["plain", "packed"])
def test_a_builder_that_fails_removes_what_it_wrote_and_its_claim(location, layout):
    with pytest.raises(RuntimeError, match="stop"):
        with tsckpt.CheckpointBuilder(location, layout=layout) as builder:
            builder.add_tensor(("gone", "x"), torch.ones(5))
            builder.add_object("blob", object())
            builder.flush()
            raise RuntimeError("stop")
    assert list(_kv(location).list().result()) == []  # nothing left that no claim marks as a save's


def test_overwrite_uncommits_first_so_a_dead_overwrite_loses_the_old_checkpoint(location):
    """The documented limit of in-place stores: no rename means no crash-safe overwrite."""
    tsckpt.save(_state(1), location)
    dead = tsckpt.CheckpointBuilder(location, overwrite=True)
    del dead
    with pytest.raises(IncompleteCheckpointError):
        tsckpt.load(_state(0), location)


def test_a_root_written_behind_the_claim_wins_and_the_save_fails(location):
    """A writer that ignores claims (an older tsckpt) commits first: this save refuses to replace it."""
    save = tsckpt.CheckpointBuilder(location)
    save.add_tensor("w", torch.full((4, 3), 1.0))
    other = {"zarr_format": 3, "node_type": "group",
             "attributes": {"tsckpt": {"format": "tsckpt", "extra": {"save_id": "f" * 32}}}}
    _kv(location).write("zarr.json", json.dumps(other).encode()).result()
    with pytest.raises(CheckpointExistsError, match=f"save {'f' * 32} committed there while save {save.save_id}"):
        save.commit()


def test_conditional_root_write_loses_to_a_root_that_appeared(s3):
    """TensorStore's conditional write itself: a PUT conditioned on 'absent' fails once the key exists."""
    kv = _kv(s3.location(BUCKET, "inplace/cond"))
    absent = kv.read("zarr.json").result().stamp.generation
    assert kv.write("zarr.json", b"first", if_equal=absent).result().generation
    assert not kv.write("zarr.json", b"second", if_equal=absent).result().generation
    assert kv.read("zarr.json").result().value == b"first"
    mem = ts.KvStore.open({"driver": "memory"}).result()
    absent = mem.read("k").result().stamp.generation
    assert mem.write("k", b"1", if_equal=absent).result().generation
    assert not mem.write("k", b"2", if_equal=absent).result().generation
