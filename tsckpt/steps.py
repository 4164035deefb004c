"""Step checkpoints under one root: find the newest committed one, prune all but the last k.

Training loops save to ``ROOT/step_1000``, ``ROOT/step_2000``...; ``ROOT`` is a local directory or an
object-store prefix, read without loading anything.

An entry directly under the root is a candidate when its name *ends with* an integer, its step (``step_1000``,
``ckpt-000500``, ``epoch3_step_1000`` -> 1000), compared as a number. A name with anything after its last digit
(``step_5_async``, ``step_5.old``) names something beside step 5, not a step: :func:`latest` never returns it
and :func:`prune` never counts or touches it.

A candidate is in one of four states:

``committed``
    its root ``zarr.json`` carries the tsckpt metadata: the commit happened, the checkpoint loads.
``incomplete``
    a tsckpt save that has not committed: a save still running, or one that died (or a prune that died).
    On an object store, recognised by its save's claim object and nothing but keys a save writes; on a local
    disk, a save stages in a hidden directory beside the entry, which is incomplete while it has only that.
``damaged``
    its root ``zarr.json`` exists but is not readable JSON.
``foreign``
    anything else: another tool's directory, Zarr arrays or groups tsckpt did not write, an empty directory,
    a symbolic link. Never returned by :func:`latest`, never touched by :func:`prune`.

Torch-free.
"""

from __future__ import annotations

import json
import logging
import os
import re
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, overload

import tensorstore as ts

from .errors import LocationError, OptionError, StorageError, TsckptError
from .commit.staged import remove_leftovers
from .commit.staging_dirs import STAGING_NAME, remove_tree, staging_path
from .commit.states import (ABSENT, ATTRIBUTE, CLAIM, COMMITTED, DAMAGED, FOREIGN, INCOMPLETE, ROOT, checkpoint_keys,
                            delete_own_keys, is_own_key, without_root)
from .storage.localfs import fsync_dir
from .storage.location import Location, LocationLike, parse_location
from .storage.context import make_context, open_kvstore
from .storage.kvio import read_json, storage_error

log = logging.getLogger(__name__)


#: A step entry's name ends with its step number (see the module docstring).
_STEP = re.compile(r"(\d+)$")


@dataclass(frozen=True)
class StepCheckpoint:
    """One candidate entry under a root of step checkpoints."""

    #: The entry's name under the root, e.g. ``"step_1000"``.
    name: str
    #: The integer ``name`` ends with.
    step: int
    #: ``committed``, ``incomplete``, ``damaged`` or ``foreign`` (see the module docstring).
    state: str
    #: Where it is, in the form the root was given (a path or URL string, or a kvstore spec dict), as
    #: ``tsckpt.open`` / ``tsckpt.load`` take it.
    location: str | dict[str, Any]
    #: The same place as text (a path or URL), for messages.
    url: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "step": self.step, "state": self.state, "url": self.url}


class _Root:
    """An opened root: its kvstore and the form its children's locations take."""

    def __init__(self, root: LocationLike):
        self.given = root
        self.location = parse_location(root)
        self.kv = open_kvstore(self.location, make_context(location=self.location))
        try:
            committed = _is_tsckpt_root(read_json(self.kv, ROOT))
        except ValueError:
            committed = False
        if committed:
            raise LocationError(f"{self.location.url} is itself a checkpoint; pass the directory or prefix "
                                "that holds the step checkpoints")

    def child(self, name: str) -> tuple[str | dict[str, Any], str]:
        """(location in the root's own form, text form) of entry ``name``."""
        spec = {**self.location.spec, "path": f"{self.location.spec.get('path', '')}{name}/"}
        url = Location(spec).url
        given = self.given
        if isinstance(given, Location):
            return {**given.to_dict(), "path": spec["path"]}, url
        if isinstance(given, Mapping):
            if "url" in given:
                return {**given, "url": f"{str(given['url']).rstrip('/')}/{name}"}, url
            return {**given, "path": spec["path"]}, url
        text = os.fspath(given)
        joined = f"{text.rstrip('/')}/{name}" if "://" in text else os.path.join(text, name)
        return joined, joined

    def entries(self) -> Iterator[tuple[str, Callable[[], list[str]] | None]]:
        """(name, a call listing the keys below it) for each directory-like entry of the root; on a local disk,
        None for a name with only a hidden staging directory of a save (beside it) and no directory of its own."""
        if self.location.driver == "file":
            yield from _local_entries(str(self.location.spec["path"]), self.location.url)
            return
        below: dict[str, list[str]] = {}
        try:
            keys = self.kv.list().result()
        except ValueError as e:
            raise storage_error(e, f"cannot list {self.location.url}") from None
        for raw in keys:
            try:
                name, sep, rest = raw.decode("utf-8").partition("/")
            except UnicodeDecodeError:
                continue  # not a name tsckpt could have written
            if sep:  # a key at the root itself is a file, never a checkpoint
                below.setdefault(name, []).append(rest)
        for name, rest in below.items():
            yield name, (lambda rest=rest: rest)

    def state(self, name: str, keys: Callable[[], list[str]] | None) -> str:
        if keys is None:
            return INCOMPLETE
        try:
            doc = read_json(self.kv, f"{name}/{ROOT}")
        except (ValueError, RecursionError):
            return DAMAGED
        if doc is not None:
            return COMMITTED if _is_tsckpt_root(doc) else FOREIGN
        below = [k for k in keys() if k]  # "" is an object store's folder marker
        state = without_root(below).state
        return FOREIGN if state == ABSENT else state

    def remove_staged(self, entry: StepCheckpoint) -> bool:
        """Remove the dead staging directories of saves into ``entry`` (local disks); whether any went."""
        target = Location({**self.location.spec, "path": os.path.join(str(self.location.spec["path"]), entry.name)})
        try:
            return bool(remove_leftovers(target))
        except OSError as e:
            raise StorageError(f"removing the leftovers of {entry.url} failed: {e}") from None

    def remove(self, entry: StepCheckpoint) -> None:
        """Delete a step checkpoint so that a prune dying half-way leaves a recognisable leftover.

        On a local disk the entry is first renamed aside, atomically, to the hidden name of a replaced checkpoint
        (``.<name>.tsckpt-<id>.old``), which ``tsckpt clean`` and the next save into the entry remove. On object
        stores a claim goes down first, then the root document (the entry no longer loads), then the rest, the
        claim last: until then the entry reads as an incomplete save. Only what a tsckpt save may have written is
        deleted; a file someone put beside the checkpoint stays (and the entry then reads as foreign).
        """
        prefix = f"{entry.name}/"
        try:
            if self.location.driver == "file":
                here = os.path.join(str(self.location.spec["path"]), entry.name)
                with open(os.path.join(here, ROOT), "rb") as f:
                    own = checkpoint_keys(f.read()) or is_own_key
                if not all(own(k) for k in _walk(here)):
                    remove_tree(here, own)  # a file someone put there stays where they put it
                    return
                aside = staging_path(os.path.realpath(here), uuid.uuid4().hex, old=True)
                os.rename(here, aside)
                fsync_dir(os.path.dirname(aside))
                remove_tree(aside, own)
                return
            raw = self.kv.read(prefix + ROOT).result()
            own = (checkpoint_keys(raw.value) if raw.state == "value" else None) or is_own_key
            claim = prefix + CLAIM
            self.kv.write(claim, json.dumps({"pruning": entry.name}).encode()).result()
            root_doc = prefix + ROOT
            self.kv.delete_range(ts.KvStore.KeyRange(root_doc, root_doc + "\0")).result()
            # "0" is the character after "/": the range is exactly the keys under the prefix.
            below = self.kv.list(ts.KvStore.KeyRange(prefix, f"{entry.name}0")).result()
            keys = [k.decode("utf-8", "replace") for k in below]
            delete_own_keys(self.kv, [k for k in keys if k != claim], entry.url, prefix, own)
            self.kv.delete_range(ts.KvStore.KeyRange(claim, claim + "\0")).result()
        except (ValueError, OSError) as e:
            raise (storage_error(e, f"removing {entry.url} failed") if isinstance(e, ValueError)
                   else StorageError(f"removing {entry.url} failed: {e}")) from None


def _is_tsckpt_root(doc: Any) -> bool:
    attrs = doc.get("attributes") if isinstance(doc, dict) else None
    return isinstance(attrs, dict) and ATTRIBUTE in attrs


def _local_entries(path: str, url: str) -> Iterator[tuple[str, Callable[[], list[str]] | None]]:
    try:
        with os.scandir(path) as it:
            dirs = [e for e in it if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return
    except NotADirectoryError:
        raise LocationError(f"{url} is a file, not a directory of step checkpoints") from None
    names = {e.name for e in dirs}
    staged = {m["name"] for e in dirs if (m := STAGING_NAME.match(e.name))}
    for e in dirs:
        yield e.name, (lambda p=e.path: _walk(p))
    for name in sorted(staged - names):
        yield name, None


def _walk(path: str) -> list[str]:
    out = []
    for dirpath, dirnames, files in os.walk(path):
        rel = os.path.relpath(dirpath, path)
        out += [f if rel == "." else f"{rel}/{f}".replace(os.sep, "/") for f in files]
        # A link below a step directory is nothing tsckpt writes: make the entry foreign.
        out += ["<link>" for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
    return out


def _candidates(root: _Root) -> list[tuple[int, str, Callable[[], list[str]]]]:
    found = []
    for name, keys in root.entries():
        if name.startswith("."):
            continue  # hidden: a save's staging directory (docs/format.md, section 8), or not ours
        step = _STEP.search(name)
        if step:
            found.append((int(step.group(1)), name, keys))
    return sorted(found, key=lambda c: (c[0], c[1]))


def _entry(root: _Root, step: int, name: str, state: str) -> StepCheckpoint:
    location, url = root.child(name)
    return StepCheckpoint(name, step, state, location, url)


def scan(root: LocationLike) -> list[StepCheckpoint]:
    """Every candidate entry directly under ``root`` with its state, oldest step first.

    ``root`` is a path, URL or kvstore spec of the directory or prefix holding the step checkpoints; a root that
    does not exist has none. On object stores this lists every key under ``root`` (S3 has no directories), so its
    cost grows with the total number of objects there.
    """
    return _scan(_Root(root))


def _scan(r: _Root) -> list[StepCheckpoint]:
    return [_entry(r, step, name, r.state(name, keys)) for step, name, keys in _candidates(r)]


@overload
def latest(root: str | os.PathLike[str]) -> str | None: ...
@overload
def latest(root: Mapping[str, Any] | Location) -> dict[str, Any] | None: ...


def latest(root: LocationLike) -> str | dict[str, Any] | None:
    """The newest committed checkpoint directly under ``root``, or None when there is none.

    The newest has the largest step (see :mod:`tsckpt.steps`); incomplete, damaged and foreign entries
    are skipped. The result has the root's form, ready for ``tsckpt.load``: a path or URL string for a
    string root (``"ckpt/step_2000"``, ``"s3://bucket/run/step_2000"``), a kvstore spec dict for a dict root::

        path = tsckpt.latest("ckpt")
        if path is not None:
            tsckpt.load(state, path)

    Reads one small ``zarr.json`` per entry, newest first, until a committed one is found (plus the listing
    of ``root``).
    """
    r = _Root(root)
    for step, name, _ in reversed(_candidates(r)):
        try:
            doc = read_json(r.kv, f"{name}/{ROOT}")
        except (ValueError, RecursionError):
            continue
        if _is_tsckpt_root(doc):
            return _entry(r, step, name, COMMITTED).location
    return None


def run_directory_error(location: LocationLike, error: TsckptError) -> TsckptError:
    """``error``, or when ``location`` holds step checkpoints rather than being one, the error that says so.

    Loading or opening a run directory (``ckpt`` instead of ``ckpt/step_1000``) finds no committed root document
    there and would be reported as an incomplete checkpoint; the message names the newest committed step and
    :func:`latest` instead, keeping ``error``'s class.
    """
    try:
        newest = latest(location)
    except (TsckptError, OSError):
        return error
    if newest is None:
        return error
    shown = os.fspath(location) if isinstance(location, (str, os.PathLike)) else parse_location(location).url
    step = newest if isinstance(newest, str) else parse_location(newest).url
    return type(error)(f"{shown} is a directory of step checkpoints, not a checkpoint: the newest committed one is "
                       f"{step}, which tsckpt.latest({shown!r}) returns (`tsckpt latest {shown}` in a shell)")


def prune(root: LocationLike, keep: int, *, dry_run: bool = False, remove_incomplete: bool = False) -> list[str]:
    """Delete all but the ``keep`` newest committed checkpoints under ``root``; return what went.

    Args:
        root: the directory or prefix holding the step checkpoints.
        keep: how many committed checkpoints to keep, newest first; at least 1, so the newest committed
            checkpoint is never deleted.
        dry_run: only report what would be deleted.
        remove_incomplete: also delete incomplete saves (no commit) whose step is *below* the newest committed
            one: leftovers of saves that died. Off by default because an older step can also be a save running
            right now (a run restarted from an older checkpoint re-saves its steps); turn it on where no such
            save can be running, e.g. from the training job itself after its own save returned. Incomplete
            saves at or above the newest committed step are never deleted: they are the saves being written.

    Damaged and foreign entries are never touched. Each checkpoint is un-committed (its root ``zarr.json``
    deleted) before its other files, so an interrupted prune never leaves a checkpoint that loads with data
    missing. Returns the removed (or, with ``dry_run``, the doomed) entries' paths or URLs, oldest first.
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise OptionError(f"prune: keep must be an integer >= 1 (the newest checkpoint is always kept), got {keep!r}")
    r = _Root(root)
    entries = _scan(r)
    committed = [e for e in entries if e.state == COMMITTED]
    doomed = committed[:-keep]
    if remove_incomplete and committed:
        newest = committed[-1].step
        doomed += [e for e in entries if e.state == INCOMPLETE and e.step < newest]
    doomed.sort(key=lambda e: (e.step, e.name))
    gone = []
    for e in doomed:
        if not dry_run:
            if e.state == INCOMPLETE and r.location.driver == "file":
                if not r.remove_staged(e):
                    continue  # its save still holds its staging directory: running, not dead
            else:
                r.remove(e)
        gone.append(e.url)
        log.info("%s %s checkpoint %s", "would remove" if dry_run else "removed", e.state, e.url)
    return gone
