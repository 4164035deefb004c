"""A save's staging directory beside its local target, ``.<name>.tsckpt-<save_id>`` (``.old`` after it: a
checkpoint it replaces, moved aside): its name, finding it, reading its root, deleting it."""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..storage.location import Location
from .states import COMMITTED, ROOT, Found, checkpoint_keys, describe_root, is_own_key

#: The name of a save's staging directory, or of a checkpoint it replaced, beside the target ``name``.
STAGING_NAME = re.compile(r"^\.(?P<name>.+)\.tsckpt-(?P<save_id>[0-9a-f]{32})(?P<old>\.old)?$")


def staging_path(target: str, save_id: str, *, old: bool = False) -> str:
    parent, name = os.path.split(target)
    return os.path.join(parent, f".{name}.tsckpt-{save_id}" + (".old" if old else ""))


@dataclass(frozen=True)
class StagingDir:
    path: str
    save_id: str
    old: bool


def staging_dirs(target: str) -> list[StagingDir]:
    """The staging (and moved-aside) directories of saves into ``target``."""
    parent, name = os.path.split(target)
    try:
        entries = os.listdir(parent)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = [(e, m) for e in sorted(entries) if (m := STAGING_NAME.match(e)) and m["name"] == name]
    return [StagingDir(os.path.join(parent, e), m["save_id"], bool(m["old"])) for e, m in found]


def read_root(path: str) -> bytes | None:
    """The root document in directory ``path`` (None: there is none; other errors raise)."""
    try:
        with open(os.path.join(path, ROOT), "rb") as f:
            return f.read()
    except (FileNotFoundError, NotADirectoryError):
        return None


def root_keys(path: str) -> Callable[[str], bool] | None:
    """Which files belong to the checkpoint whose root document is in ``path`` (None: no root)."""
    raw = read_root(path)
    return None if raw is None else checkpoint_keys(raw) or is_own_key


def committed(path: str) -> Found | None:
    """What the root document under ``path`` says, if it commits a checkpoint."""
    try:
        raw = read_root(path)
    except OSError:
        return None
    found = describe_root(raw) if raw is not None else None
    return found if found is not None and found.state == COMMITTED else None


def remove_tree(path: str, own: Callable[[str], bool] | None = None) -> None:
    """Delete a staged or replaced checkpoint: its root document first, so no half-deleted tree is committed.

    Only files a tsckpt save may have written go (those its root names, or ``own``, or by their names in a
    tree that never committed); anything else, and the directories holding it, stay.
    """
    if own is None:
        with contextlib.suppress(OSError):
            own = root_keys(path)
    own = own or is_own_key
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        os.unlink(os.path.join(path, ROOT))
    for top, dirs, files in os.walk(path, topdown=False):
        for name in files:
            full = os.path.join(top, name)
            if own(os.path.relpath(full, path).replace(os.sep, "/")):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(full)
        with contextlib.suppress(FileNotFoundError, OSError):
            os.rmdir(top)  # fails, as it should, where something tsckpt did not write remains


def tree_state(path: str) -> tuple[int, int, int]:
    """Files, bytes and the newest modification time (ns) under ``path``: what changes while writes land."""
    files = nbytes = newest = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                st = os.lstat(os.path.join(root, name))
            except FileNotFoundError:
                continue
            files, nbytes, newest = files + 1, nbytes + st.st_size, max(newest, st.st_mtime_ns)
    return files, nbytes, newest


def tree_bytes(path: str) -> int:
    return tree_state(path)[1]


def settle(path: str, *, quiet: float = 0.25, limit: float = 10.0) -> None:
    """Wait until nothing under ``path`` has changed for ``quiet`` seconds, or ``limit`` seconds have passed: a
    rank stopped by Ctrl-C leaves its writes running, and files they create after a removal would remake it."""
    deadline = time.monotonic() + limit
    last, calm_since = tree_state(path), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = tree_state(path)
        if now != last:
            last, calm_since = now, time.monotonic()
        elif time.monotonic() - calm_since >= quiet:
            return


def target_path(loc: Location) -> str:
    """The real path of a local location's target directory."""
    return os.path.realpath(str(loc.spec.get("path", "")).rstrip("/") or "/")


def hint(path: str) -> str:
    """What to tell a reader that finds nothing at ``path`` but staging directories beside it."""
    dirs = staging_dirs(os.path.realpath(path))
    if not dirs:
        return ""
    complete = [d for d in dirs if not d.old and committed(d.path) is not None]
    if complete and any(d.old for d in dirs):
        return (f"; a publication that did not finish left the new checkpoint in {complete[0].path}: "
                f"`tsckpt clean {path}` finishes it")
    many = len(dirs) != 1
    return (f"; {len(dirs)} leftover staging director{'ies' if many else 'y'} of saves that did not finish "
            f"{'are' if many else 'is'} beside it (`tsckpt clean {path}` removes dead ones)")
