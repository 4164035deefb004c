"""Saves into object stores and memory: written in place, fenced by a claim, committed by a conditional write.

Of two saves starting together one gets the claim and the other fails before writing anything. Overwriting
deletes the old root before the new data is written: not crash-safe on these stores (``docs/publication.md``).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
from typing import Any

import tensorstore as ts

from ..errors import ConcurrentSaveError, TsckptError
from ..storage.context import make_context, open_kvstore
from ..storage.kvio import problem, storage_error
from ..storage.location import Location
from .states import (ABSENT, CLAIM, COMMITTED, INCOMPLETE, ROOT, Found, Survey, checkpoint_keys, claim_fields, classify,
                     delete_own_keys, describe_root, is_own_key, list_keys, read_key, read_root, refuse)
from .target import Leftover, SaveTarget

#: A claim's ``keys`` when every key its save's ranks write carries its save id (the packed layout).
OWN_KEYS_ONLY = "own"


class InPlaceTarget(SaveTarget):
    """Write in place; fence with a claim object; commit with a conditional write of the root, after turning the
    claim into a committing one, again only if it is still this save's."""

    def __init__(self, location: Location, save_id: str, overwrite: bool):
        super().__init__(location, save_id, overwrite)
        self._kv: ts.KvStore | None = None
        self._claim_generation: bytes | None = None
        self._started: str | None = None
        self._aborted: tuple[str | None] | None = None

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
        survey = Survey(kv, self.url, claim=True)
        claim = survey.claim()
        if claim.state == "value":
            self._refuse_claim(claim.value)
        found = classify(kv, self.url, inside=self.overwrite, survey=survey)
        refuse(found, self.url, overwrite=self.overwrite, save_id=self.save_id)
        try:
            doc = self._claim_document()
            written = kv.write(CLAIM, doc, if_equal=claim.stamp.generation).result()
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

    def _refuse_claim(self, raw: bytes) -> None:
        """Raise unless ``overwrite`` may take over the claim ``raw``: only where the save holding it can never
        write into this one's checkpoint. An object store cannot stop a write on its way, so every key its ranks
        write must carry its save id (packed), and it must not be committing."""
        holder, fields = describe_claim(raw), claim_fields(raw)
        command = f"`tsckpt clean --force {self.url}`"
        if fields.get("committing"):
            raise ConcurrentSaveError(f"{self.url}: {holder} is committing there; save {self.save_id} was refused "
                                      f"and wrote nothing (if that save died, {command} removes its claim)")
        fenced = fields.get("keys") == OWN_KEYS_ONLY
        if self.overwrite and fenced:
            return
        if not self.overwrite:
            remedy = f"pass overwrite=True or run {command}" if fenced else f"run {command}"
            raise ConcurrentSaveError(f"{self.url}: {holder} has not finished: it is still running, or it died; "
                                      f"if no save is running there, {remedy}")
        raise ConcurrentSaveError(
            f"{self.url}: {holder} has not finished (it is still running, or it died), and overwrite=True cannot "
            f"take the location over: that save may write keys this one writes (only a packed save's all carry "
            f"its save id), and its writes still on their way would land in this save's checkpoint; save "
            f"{self.save_id} wrote nothing (if no save is running there, {command} removes its claim)")

    def _claim_document(self, **fields: Any) -> bytes:
        """The claim, saying ``fields`` and whether every key this save's ranks write carries its save id."""
        fields["keys"] = OWN_KEYS_ONLY if self._own_keys_only() else None
        if self._started is None:
            self._started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        given = {k: v for k, v in fields.items() if v is not None}
        return json.dumps({"save_id": self.save_id, "host": socket.gethostname(), "pid": os.getpid(),
                           "started": self._started, **given}).encode()

    def record_writes(self, prefixes: tuple[str, ...]) -> None:
        """Also say in the claim when every key this save's ranks write carries its save id: only then may a save
        with ``overwrite`` take the location over while this one runs."""
        said = self._own_keys_only()
        super().record_writes(prefixes)
        if self._claim_generation is not None and self._own_keys_only() != said:
            self._rewrite_claim()

    def _own_keys_only(self) -> bool:
        return bool(self.written) and all(p.startswith(f"d/{self.save_id}") for p in self.written)

    def _rewrite_claim(self, **fields: Any) -> None:
        """Replace this save's claim with one saying ``fields``, only if it is still this save's."""
        doc = self._claim_document(**fields)
        try:
            written = self.kv.write(CLAIM, doc, if_equal=self._claim_generation).result()
            generation = written.generation
            if not generation:  # or the answer was lost after the write took effect
                found = read_key(self.kv, CLAIM, self.url)
                generation = found.stamp.generation if found.state == "value" and found.value == doc else None
        except ValueError as e:
            raise storage_error(e, f"{self.url}: cannot update the claim of save {self.save_id}") from None
        if not generation:
            self.check_current()
            raise ConcurrentSaveError(f"{self.url}: the claim of save {self.save_id} changed under it; "
                                      f"it was not committed")
        self._claim_generation = generation

    def begin_commit(self) -> None:
        """Turn this save's claim into a committing one, only if it still holds it: from then on no save
        takes the location over, so the nodes and the root document this save writes next are its own."""
        self._rewrite_claim(committing=True)

    def check_current(self, claim: ts.KvStore.ReadResult | None = None) -> None:
        """``claim``: the claim as just read, if it was."""
        claim = claim or read_key(self.kv, CLAIM, self.url)
        if claim.state != "value" or claim.stamp.generation != self._claim_generation:
            holder = describe_claim(claim.value) if claim.state == "value" else "no save"
            raise ConcurrentSaveError(f"{self.url}: {holder} holds this location now; save {self.save_id} "
                                      f"was overtaken (another save passed overwrite=True) and was not committed")

    def commit_root(self, kv: ts.KvStore, root: bytes) -> None:
        survey = Survey(kv, self.url, claim=True, listing=False)
        self.check_current(survey.claim())  # again: the nodes took time
        raw, generation = survey.root()
        if raw is not None:
            refuse(describe_root(raw), self.url, overwrite=False, save_id=self.save_id, at_commit=True)
        if not kv.write(ROOT, root, if_equal=generation).result().generation and not self._own_generation(kv, ROOT):
            raw, _ = read_root(kv, self.url)
            found = describe_root(raw) if raw is not None else Found(COMMITTED, "another save's commit")
            refuse(found, self.url, overwrite=False, save_id=self.save_id, at_commit=True)
            raise ConcurrentSaveError(f"{self.url}: the root document changed while save {self.save_id} "
                                      f"committed; it was not committed")
        self._release_quietly()  # committed all the same

    def _own_generation(self, kv: ts.KvStore, key: str) -> bytes | None:
        """After a conditional write of ``key`` reported "not written": its generation if it is this save's anyway
        (an answer lost after the write took effect makes the retry fail its condition against the write)."""
        found = read_key(kv, key, self.url)
        if found.state != "value":
            return None
        owner = describe_root(found.value).save_id if key == ROOT else claim_fields(found.value).get("save_id")
        return found.stamp.generation if owner == self.save_id else None

    def abort(self) -> str | None:
        """Delete the data this save wrote in place, then its claim; returns None once nothing of it is left.

        Deleted only while this save's claim fences the location, or where every key it wrote carries its save
        id; nothing when the root commits this save after all. What is left is listed, and the claim stays.
        """
        if self._aborted is None:
            self._aborted = (self._abort(),)
        return self._aborted[0]

    def _abort(self) -> str | None:
        if self._claim_generation is None:
            return None  # no claim was written: nothing was
        try:
            claim = read_key(self.kv, CLAIM, self.url)
            holds = claim.state == "value" and claim.stamp.generation == self._claim_generation
            if not holds and not self._own_keys_only():
                self.check_current()  # raises: says which save holds the location now
            raw, _ = read_root(self.kv, self.url)
            if raw is not None and describe_root(raw).save_id == self.save_id:
                self._release_quietly()
                return None
            if self.written:
                # Key by key, and only a save's: an array's path may hold files of someone else's.
                delete_own_keys(self.kv, self._written_keys(), self.url)
                left = self._written_keys()
            else:  # where it wrote was not recorded (CheckpointBuilder): every key a save writes, under its claim
                if raw is None:
                    delete_own_keys(self.kv, [k for k in list_keys(self.kv, self.url) if k != CLAIM], self.url)
                left = [k for k in list_keys(self.kv, self.url) if k != CLAIM and is_own_key(k)]
        except (ValueError, TsckptError) as e:
            return f"{problem(e)}; once no save is running there, `tsckpt clean --force {self.url}` removes it"
        if left:
            return (f"{len(left)} key(s) it wrote are still there, e.g. {left[0]!r}; once no save is running "
                    f"there, `tsckpt clean --force {self.url}` removes them")
        if holds:
            self._release_quietly()
        return None

    def _written_keys(self) -> list[str]:
        return [k for k in list_keys(self.kv, self.url) if k.startswith(self.written) and is_own_key(k)]

    def _release_quietly(self) -> None:
        try:
            if self._claim_generation is not None:
                self.kv.write(CLAIM, None, if_equal=self._claim_generation).result()
                self._claim_generation = None
        except ValueError:
            pass  # the claim left behind is reported, and cleaned with --force

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


def describe_claim(raw: bytes) -> str:
    doc = claim_fields(raw)
    try:
        return f"save {doc['save_id']} (started {doc['started']} by pid {doc['pid']} on {doc['host']})"
    except KeyError:
        return "a save of unknown origin"


