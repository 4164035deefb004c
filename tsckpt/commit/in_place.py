"""Saves into object stores and memory: written in place, fenced by a claim, committed by a conditional write.

The claim is written only if the generation seen a moment before still
holds, so of two saves starting together one gets it and the other fails
before writing anything. Overwriting takes over any claim and deletes the
old root before the new data is written: not crash-safe on these stores.
"""

from __future__ import annotations

import datetime
import json
import os
import socket

import tensorstore as ts

from ..errors import ConcurrentSaveError, TsckptError
from ..storage.context import make_context, open_kvstore
from ..storage.kvio import problem, storage_error
from ..storage.kvio import prefix_range
from ..storage.location import Location
from .states import (
    ABSENT,
    CLAIM,
    COMMITTED,
    INCOMPLETE,
    ROOT,
    Found,
    checkpoint_keys,
    classify,
    delete_own_keys,
    is_own_key,
    describe_root,
    list_keys,
    read_key,
    read_root,
    refuse,
)
from .target import Leftover, SaveTarget


class InPlaceTarget(SaveTarget):
    """Write in place; fence with a claim object; commit with a conditional write of the root.

    The claim is written only if the generation seen a moment before still
    holds, so of two saves starting together one gets it and the other fails
    before writing anything. Overwriting takes over any claim and deletes the
    old root before the new data is written: not crash-safe on these stores.
    """

    def __init__(self, location: Location, save_id: str, overwrite: bool):
        super().__init__(location, save_id, overwrite)
        self._kv: ts.KvStore | None = None
        self._claim_generation: bytes | None = None

    @property
    def data_location(self) -> Location:
        return self.location

    @property
    def kv(self) -> ts.KvStore:
        if self._kv is None:
            self._kv = open_kvstore(self.location, make_context(location=self.location))
        return self._kv

    def begin(self) -> None:
        kv = self.kv
        claim = read_key(kv, CLAIM, self.url)
        if claim.state == "value" and not self.overwrite:
            raise ConcurrentSaveError(
                f"{self.url}: {describe_claim(claim.value)} has not finished: it is still running, or it "
                f"died; if no save is running there, pass overwrite=True or run `tsckpt clean --force "
                f"{self.url}`")
        found = classify(kv, self.url, inside=self.overwrite)
        refuse(found, self.url, overwrite=self.overwrite, save_id=self.save_id)
        try:
            written = kv.write(CLAIM, self._claim_document(), if_equal=claim.stamp.generation).result()
            generation = written.generation or self._own_generation(kv, CLAIM)
            if not generation:
                raise ConcurrentSaveError(f"{self.url}: another save claimed this location at the same time as "
                                          f"save {self.save_id}; nothing was written")
            self._claim_generation = generation
            if found.state != ABSENT:
                raw, _ = read_root(kv, self.url)
                own = (checkpoint_keys(raw) if raw is not None else None) or is_own_key
                # Un-commit first: from here on the location is incomplete, never a mix. Keys are
                # deleted one by one, never by range, so what appeared since the listing survives.
                kv.delete_range(ts.KvStore.KeyRange(ROOT, ROOT + "\0")).result()
                delete_own_keys(kv, [k for k in list_keys(kv, self.url) if k != CLAIM], self.url, "", own)
        except ValueError as e:
            raise storage_error(e, f"cannot prepare {self.url} for save {self.save_id}") from None

    def _claim_document(self) -> bytes:
        return json.dumps({"save_id": self.save_id, "host": socket.gethostname(), "pid": os.getpid(),
                           "started": _now()}).encode()

    def check_current(self) -> None:
        claim = read_key(self.kv, CLAIM, self.url)
        if claim.state != "value" or claim.stamp.generation != self._claim_generation:
            holder = describe_claim(claim.value) if claim.state == "value" else "no save"
            raise ConcurrentSaveError(f"{self.url}: {holder} holds this location now; save {self.save_id} "
                                      f"was overtaken (another save passed overwrite=True) and was not committed")

    def commit_root(self, kv: ts.KvStore, root: bytes) -> None:
        self.check_current()  # again: the nodes took time
        raw, generation = read_root(kv, self.url)
        if raw is not None:
            refuse(describe_root(raw), self.url, overwrite=False, save_id=self.save_id, at_commit=True)
        if not kv.write(ROOT, root, if_equal=generation).result().generation and not self._own_generation(kv, ROOT):
            raw, _ = read_root(kv, self.url)
            found = describe_root(raw) if raw is not None else Found(COMMITTED, "another save's commit")
            refuse(found, self.url, overwrite=False, save_id=self.save_id, at_commit=True)
            raise ConcurrentSaveError(f"{self.url}: the root document changed while save {self.save_id} "
                                      f"committed; it was not committed")
        try:
            self._release()
        except ValueError:
            pass  # committed all the same; the claim left behind is reported, and cleaned with --force

    def _own_generation(self, kv: ts.KvStore, key: str) -> bytes | None:
        """After a conditional write of ``key`` reported "not written": its generation if it is this save's anyway.

        An object store's answer can be lost after the write took effect; the
        retried request then fails its condition against the write's own result.
        """
        found = read_key(kv, key, self.url)
        if found.state != "value":
            return None
        owner = describe_root(found.value).save_id if key == ROOT else _claim_save_id(found.value)
        return found.stamp.generation if owner == self.save_id else None

    def _release(self) -> None:
        if self._claim_generation is not None:
            self.kv.write(CLAIM, None, if_equal=self._claim_generation).result()
            self._claim_generation = None

    def abort(self) -> str | None:
        """Delete the data this save wrote in place (while its claim still fences the location), then the claim.

        Nothing is deleted when another save overtook this one (it may be
        writing the same keys), nor when the root document commits this save
        after all (the write that seemed to fail took effect).
        """
        try:
            if self.written and self._claim_generation is not None:
                self.check_current()
                raw, _ = read_root(self.kv, self.url)
                if raw is None or describe_root(raw).save_id != self.save_id:
                    for prefix in self.written:
                        self.kv.delete_range(prefix_range(prefix)).result()
        except (ValueError, TsckptError) as e:
            # The claim stays: it is what marks the data left behind as this save's to remove.
            return (f"{problem(e)}; once no save is running there, `tsckpt clean --force {self.url}` "
                    f"removes it")
        try:
            self._release()
        except ValueError:
            pass
        return None

    @classmethod
    def leftovers(cls, location: Location) -> list[Leftover]:
        claim = read_key(open_kvstore(location, make_context(location=location)), CLAIM, location.url)
        if claim.state != "value":
            return []
        return [Leftover(f"{location.url}/{CLAIM}", len(claim.value), None,
                         f"claim of {describe_claim(claim.value)}, which has not finished")]

    @classmethod
    def clean(cls, location: Location, *, force: bool) -> list[Leftover]:
        found = cls.leftovers(location)
        if not force or not found:
            return []
        kv = open_kvstore(location, make_context(location=location))
        if classify(kv, location.url).state == INCOMPLETE:
            delete_own_keys(kv, list_keys(kv, location.url), location.url)  # the dead save's data and claim
        else:
            kv.write(CLAIM, None).result()
        return found


def _claim_save_id(raw: bytes) -> str | None:
    try:
        save_id = json.loads(raw).get("save_id")
    except (ValueError, AttributeError):
        return None
    return save_id if isinstance(save_id, str) else None


def describe_claim(raw: bytes) -> str:
    try:
        doc = json.loads(raw)
        return f"save {doc['save_id']} (started {doc['started']} by pid {doc['pid']} on {doc['host']})"
    except (ValueError, KeyError, TypeError):
        return "a save of unknown origin"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


