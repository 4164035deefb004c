"""Where a save writes and how it becomes the checkpoint: refusals, fencing, publication, leftovers.

A save never writes where readers look until it is complete and committed:

* **Local filesystems** (driver ``file``): every save writes into its own hidden
  staging directory beside the target, ``.<name>.tsckpt-<save_id>``, commits
  there, and is published by one atomic rename, or by an atomic exchange with
  the checkpoint it replaces (:mod:`tsckpt.format.localdir`).
* **Object stores and memory** (no rename): the save writes in place. A claim
  object written with a conditional write fences off other saves, and the root
  document is committed with a conditional write (:class:`InPlaceTarget`).

:func:`begin_save` runs once per save, on its coordinator, before any data is
written; it refuses a committed checkpoint (unless overwriting) and content
tsckpt did not write, and removes leftovers of dead saves. Its
:meth:`SaveTarget.commit_root` writes the root document and publishes it,
re-checking the refusals, since another save may have committed meanwhile.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import re
import socket
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import tensorstore as ts

from ..errors import CheckpointExistsError, ConcurrentSaveError, FileInTheWayError, ForeignContentError, TsckptError
from ..kvio import problem, storage_error
from ..location import Location, LocationLike, make_context, open_kvstore, parse_location
from .packed import prefix_range

ROOT = "zarr.json"
ATTRIBUTE = "tsckpt"
#: The object that fences a running save on stores without rename; a name no
#: array path can take (escaped node names never start with ".").
CLAIM = ".tsckpt-claim.json"

ABSENT, INCOMPLETE, COMMITTED, FOREIGN, FILE = "absent", "incomplete", "committed", "foreign", "file"

#: Keys a tsckpt save writes: node documents and chunk keys of either separator,
#: the packed layout's OCDBT manifests and data files, and the claim. A location
#: holding only these and no root is a dead save's leftovers.
OWN_KEYS: list[re.Pattern[str]] = [
    re.compile(r"(?:^|/)(?:zarr\.json|c|c(?:\.\d+)+)$"),
    re.compile(r"(?:^|/)c(?:/\d+)+$"),
    re.compile(r"^(?:ocdbt\.process_\d+/)?(?:manifest\.ocdbt|d/[0-9a-f]{32})$"),
    re.compile(re.escape(CLAIM) + "$"),
]


#: TensorStore's file driver writes ``<key>.__lock`` beside a key while it replaces it.
LOCK_SUFFIX = ".__lock"


def is_own_key(key: str) -> bool:
    """Whether a save of tsckpt's (any layout) may have written ``key``, relative to its location."""
    key = key.removesuffix(LOCK_SUFFIX)
    return any(p.search(key) for p in OWN_KEYS)


@dataclass(frozen=True)
class Found:
    """What a location holds, as far as saving there is concerned."""

    state: str
    #: What was found, in words, for messages.
    what: str = ""
    #: For a committed checkpoint, the save that wrote it (from ``extra.save_id``).
    save_id: str | None = None


def _read(kv: ts.KvStore, key: str, url: str) -> ts.KvStore.ReadResult:
    try:
        return kv.read(key).result()
    except ValueError as e:
        raise storage_error(e, f"{url}: cannot read {key!r}") from None


def read_root(kv: ts.KvStore, url: str) -> tuple[Any, bytes]:
    """The root document's bytes (None when absent) and its storage generation."""
    result = _read(kv, ROOT, url)
    return (result.value if result.state == "value" else None), result.stamp.generation


def describe_root(raw: bytes) -> Found:
    """Classify a location by its root document alone."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        # A damaged checkpoint must be replaced on purpose, like any other.
        return Found(COMMITTED, f"a {ROOT} that is not valid JSON (a damaged checkpoint?)")
    attrs = doc.get("attributes") if isinstance(doc, dict) else None
    if isinstance(attrs, dict) and ATTRIBUTE in attrs:
        md = attrs[ATTRIBUTE]
        extra = md.get("extra") if isinstance(md, dict) else None
        save_id = extra.get("save_id") if isinstance(extra, dict) else None
        created = md.get("created") if isinstance(md, dict) else None
        return Found(COMMITTED, f"a tsckpt checkpoint (save {save_id}, created {created})",
                     save_id=save_id if isinstance(save_id, str) else None)
    if isinstance(doc, dict) and doc.get("zarr_format") in (2, 3):
        node = doc.get("node_type", "node")
        return Found(FOREIGN, f"a Zarr {node} that tsckpt did not write (its {ROOT} has no "
                              f"'{ATTRIBUTE}' attributes)")
    return Found(FOREIGN, f"a {ROOT} that is not a Zarr document")


def classify(kv: ts.KvStore, url: str) -> Found:
    """Whether the kvstore at ``url`` holds nothing, a committed checkpoint, a dead save's leftovers, or other data."""
    raw, _ = read_root(kv, url)
    if raw is not None:
        return describe_root(raw)
    try:
        keys = [k.decode("utf-8", "replace") for k in kv.list().result()]
    except ValueError as e:
        raise storage_error(e, f"{url}: cannot list it") from None
    if not keys:
        return Found(ABSENT)
    foreign = [k for k in keys if not is_own_key(k)]
    if foreign:
        return Found(FOREIGN, f"{len(foreign)} file(s) tsckpt did not write, e.g. {sorted(foreign)[0]!r}")
    return Found(INCOMPLETE, f"{len(keys)} file(s) of a save that did not finish")


def refuse(found: Found, url: str, *, overwrite: bool, save_id: str, at_commit: bool = False) -> None:
    """Raise unless saving over ``found`` is allowed: a checkpoint or foreign data needs overwrite."""
    if overwrite:
        return
    if found.state == COMMITTED:
        if at_commit:
            raise CheckpointExistsError(
                f"Checkpoint already exists at {url}: save {found.save_id} committed there while save "
                f"{save_id} was running; save {save_id} was not published (pass overwrite=True to replace)")
        raise CheckpointExistsError(
            f"Checkpoint already exists at {url}: {found.what}; pass overwrite=True to replace it")
    if found.state == FILE:
        raise FileInTheWayError(f"{url} is a file, not a checkpoint directory; refusing to replace it: "
                                  f"pass overwrite=True to replace it, or choose another location")
    if found.state == FOREIGN:
        raise ForeignContentError(
            f"{url} holds {found.what}; refusing to replace it: pass overwrite=True to replace "
            f"it, or choose another location")


@dataclass(frozen=True)
class Leftover:
    """Something a save that did not finish left beside or inside a location."""

    path: str
    nbytes: int
    #: True: the save that made it is running; False: it is dead; None: cannot tell.
    live: bool | None
    what: str

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "nbytes": self.nbytes, "live": self.live, "what": self.what}


class SaveTarget(ABC):
    """One save's view of its target: where its data goes, and how its root document becomes visible."""

    def __init__(self, location: Location, save_id: str, overwrite: bool):
        self.location = location
        self.save_id = save_id
        self.overwrite = overwrite

    @property
    def url(self) -> str:
        return self.location.url

    @property
    @abstractmethod
    def data_location(self) -> Location:
        """Where every rank writes this save's chunks and nodes."""

    @abstractmethod
    def begin(self) -> None:
        """Coordinator, before any data: refuse, fence off other saves, clear leftovers."""

    @abstractmethod
    def commit_root(self, kv: ts.KvStore, root: bytes) -> None:
        """Write the root document through ``kv`` (a kvstore at :attr:`data_location`) and publish it."""

    def check_current(self) -> None:
        """Coordinator, before the commit writes anything shared: raise if this save can no longer commit.

        A save that another one has overtaken must not write node documents
        or join databases into what the other save committed.
        """

    #: Key prefixes under :attr:`data_location` that this save's ranks write before its commit.
    written: tuple[str, ...] = ()

    def record_writes(self, prefixes: tuple[str, ...]) -> None:
        """Coordinator, before any rank writes: where the data will go, for :meth:`abort` to remove."""
        self.written = tuple(prefixes)

    def abort(self) -> str | None:
        """Best effort, after a failure this process knows of: drop what only this save used.

        Returns None when what the save wrote is gone, else what is left and why.
        """
        return None

    @classmethod
    @abstractmethod
    def leftovers(cls, location: Location) -> list[Leftover]:
        """What saves into ``location`` that did not finish left there (running ones marked live)."""

    @classmethod
    @abstractmethod
    def clean(cls, location: Location, *, force: bool) -> list[Leftover]:
        """Remove dead saves' leftovers (``force``: also those that may belong to a running save)."""


# --- object stores and memory: in place, fenced by a claim -----------------------------------------

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
        claim = _read(kv, CLAIM, self.url)
        if claim.state == "value" and not self.overwrite:
            raise ConcurrentSaveError(
                f"{self.url}: {describe_claim(claim.value)} has not finished: it is still running, or it "
                f"died; if no save is running there, pass overwrite=True or run `tsckpt clean --force "
                f"{self.url}`")
        found = classify(kv, self.url)
        refuse(found, self.url, overwrite=self.overwrite, save_id=self.save_id)
        try:
            written = kv.write(CLAIM, self._claim_document(), if_equal=claim.stamp.generation).result()
            generation = written.generation or self._own_generation(kv, CLAIM)
            if not generation:
                raise ConcurrentSaveError(f"{self.url}: another save claimed this location at the same time as "
                                          f"save {self.save_id}; nothing was written")
            self._claim_generation = generation
            if found.state != ABSENT:
                # Un-commit first: from here on the location is incomplete, never a mix.
                kv.delete_range(ts.KvStore.KeyRange(ROOT, ROOT + "\0")).result()
                kv.delete_range(ts.KvStore.KeyRange("", CLAIM)).result()
                kv.delete_range(ts.KvStore.KeyRange(CLAIM + "\0", "")).result()
        except ValueError as e:
            raise storage_error(e, f"cannot prepare {self.url} for save {self.save_id}") from None

    def _claim_document(self) -> bytes:
        return json.dumps({"save_id": self.save_id, "host": socket.gethostname(), "pid": os.getpid(),
                           "started": _now()}).encode()

    def check_current(self) -> None:
        claim = _read(self.kv, CLAIM, self.url)
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
        found = _read(kv, key, self.url)
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
        left = None
        try:
            if self.written and self._claim_generation is not None:
                self.check_current()
                raw, _ = read_root(self.kv, self.url)
                if raw is None or describe_root(raw).save_id != self.save_id:
                    for prefix in self.written:
                        self.kv.delete_range(prefix_range(prefix)).result()
        except (ValueError, TsckptError) as e:
            left = (f"{problem(e)}; once no save is running there, `tsckpt clean --force {self.url}` "
                    f"removes it")
        try:
            self._release()
        except ValueError:
            pass
        return left

    @classmethod
    def leftovers(cls, location: Location) -> list[Leftover]:
        claim = _read(open_kvstore(location, make_context(location=location)), CLAIM, location.url)
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
            kv.delete_range(ts.KvStore.KeyRange()).result()  # the dead save's data, and its claim
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


# --- choosing a target ---------------------------------------------------------------------------

def target_kind(location: Location) -> type[SaveTarget]:
    """The kind of target for a location's kvstore driver: staged where renames exist, in place elsewhere."""
    local = importlib.import_module(".localdir", __package__)  # imports this module: loaded on first use
    kinds: dict[str, type[SaveTarget]] = {"file": local.StagedTarget}
    return kinds.get(location.driver, InPlaceTarget)


def begin_save(location: LocationLike, *, save_id: str, overwrite: bool) -> SaveTarget:
    """Start a save into ``location``: checks, fencing and leftover removal; returns its target."""
    loc = parse_location(location)
    target = target_kind(loc)(loc, save_id, overwrite)
    target.begin()
    return target


def leftovers(location: LocationLike) -> list[Leftover]:
    """Leftovers of saves into ``location`` that did not finish (running saves' data included, marked live)."""
    loc = parse_location(location)
    return target_kind(loc).leftovers(loc)


def clean(location: LocationLike, *, force: bool = False) -> list[Leftover]:
    """Remove leftovers of dead saves into ``location``; returns what was removed.

    Without ``force`` only what is known to be dead goes: staging directories
    whose save's lock is free (local filesystems), after finishing a
    publication that died half-way. ``force`` also removes what cannot be told
    apart from a running save: claims on object stores (and, when no checkpoint
    is committed there, the dead save's data), and staging directories on
    filesystems without locks. A committed checkpoint is never touched.
    """
    loc = parse_location(location)
    return target_kind(loc).clean(loc, force=force)
