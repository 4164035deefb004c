"""Publishing a staged save into a local directory that holds other files: beside them, never over them.

Under a claim in the target, the replaced checkpoint goes aside (its root first), the new files go in, the new
root last; :func:`finish_merge` goes on after a crash (``docs/publication.md``, step 5).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable

from ..errors import FileInTheWayError
from ..storage.localfs import fsync_dir, liveness
from .staging_dirs import read_root, remove_tree, root_keys, staging_path
from .states import CLAIM, ROOT, claim_fields, describe_root


def merge(staging: str, target: str, save_id: str, old_own: Callable[[str], bool] | None, url: str) -> list[str]:
    """Publish the committed ``staging`` directory into ``target`` beside its other files; ``old_own`` names the
    files of the checkpoint it replaces (None: none). Returns the trees left to delete."""
    in_the_way = _in_the_way(staging, target, old_own)
    if in_the_way:
        raise FileInTheWayError(
            f"{url} holds {in_the_way[0]!r} where save {save_id} writes its own files; it was not "
            f"published (tsckpt never writes over what it did not write): move that file, or save elsewhere")
    aside = staging_path(target, save_id, old=True)
    # Marks the target as being published into, for finish_merge.
    _put_claim(target, aside, {"save_id": save_id, "publishing": True}, new=True)
    _complete_merge(target, staging, aside, save_id, old_own, aside_done=False)
    return [aside, staging]


def _files(path: str) -> list[str]:
    out = []
    for top, _, names in os.walk(path):
        rel = os.path.relpath(top, path).replace(os.sep, "/")
        out += [name if rel == "." else f"{rel}/{name}" for name in names]
    return out


def _in_the_way(staging: str, target: str, old_own: Callable[[str], bool] | None, rel: str = "") -> list[str]:
    """What in ``target`` stands where a file or directory of ``staging`` goes (not the replaced checkpoint's own
    files, which go aside first)."""
    found = []
    for name in sorted(os.listdir(os.path.join(staging, rel) if rel else staging)):
        key = f"{rel}{name}"
        if key == ROOT:
            continue
        there = os.path.join(target, key)
        if not os.path.lexists(there):
            continue
        mine_is_dir = os.path.isdir(os.path.join(staging, key))
        if mine_is_dir and os.path.isdir(there) and not os.path.islink(there):
            found += _in_the_way(staging, target, old_own, key + "/")
        elif mine_is_dir or os.path.isdir(there) or old_own is None or not old_own(key):
            found.append(key)
    return found


def _move_aside(target: str, aside: str, old_own: Callable[[str], bool]) -> None:
    """Un-commit the checkpoint at ``target`` and move its files into ``aside``, its root document first;
    run again after a crash, it goes on where it stopped."""
    os.makedirs(aside, exist_ok=True)
    if os.path.exists(os.path.join(target, ROOT)):
        os.rename(os.path.join(target, ROOT), os.path.join(aside, ROOT))
        fsync_dir(target)
    emptied = set()
    for key in _files(target):
        if key in (ROOT, CLAIM) or not old_own(key):
            continue
        os.makedirs(os.path.dirname(os.path.join(aside, key)), exist_ok=True)
        os.rename(os.path.join(target, key), os.path.join(aside, key))
        parts = key.split("/")[:-1]
        emptied |= {"/".join(parts[:i]) for i in range(1, len(parts) + 1)}
    for rel in sorted(emptied, key=lambda d: -d.count("/")):  # only directories that held its files
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(target, rel))
    fsync_dir(aside)


def _move_in(staging: str, target: str, rel: str = "") -> set[str]:
    """Move everything but the root document from ``staging`` into ``target``, whole directories where the
    target has none of that name; returns the directories that got new entries."""
    into = os.path.join(target, rel) if rel else target
    changed = set()
    for name in sorted(os.listdir(os.path.join(staging, rel) if rel else staging)):
        key = f"{rel}{name}"
        if key == ROOT:
            continue
        there = os.path.join(target, key)
        if os.path.isdir(there) and not os.path.islink(there) and os.path.isdir(os.path.join(staging, key)):
            changed |= _move_in(staging, target, key + "/")
        else:
            os.rename(os.path.join(staging, key), there)  # fails where something is in the way
            changed.add(into)
    return changed


def _put_claim(target: str, aside: str, doc: dict[str, object], *, new: bool) -> None:
    """Write the claim of a publication beside other files: created only if absent (``new``), else replaced in
    one step (written in ``aside``, which is this save's, then renamed in)."""
    path = os.path.join(target if new else aside, CLAIM)
    with open(path, "x" if new else "w") as f:
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())
    if not new:
        os.replace(path, os.path.join(target, CLAIM))
    fsync_dir(target)


def _complete_merge(target: str, staging: str, aside: str, save_id: str,
                    old_own: Callable[[str], bool] | None, *, aside_done: bool) -> None:
    """The steps of a publication beside other files after its claim is down; run again after a crash, it
    goes on where it stopped. Until the claim says the replaced checkpoint is all aside (``aside_done``),
    the target holds none of the new checkpoint's files: both may name the same keys."""
    if old_own is not None and not aside_done:
        _move_aside(target, aside, old_own)
        _put_claim(target, aside, {"save_id": save_id, "publishing": True, "aside": True}, new=False)
    for directory in _move_in(staging, target) | {target}:
        fsync_dir(directory)
    if os.path.exists(os.path.join(staging, ROOT)):
        os.rename(os.path.join(staging, ROOT), os.path.join(target, ROOT))  # the commit, at the target
    fsync_dir(target)
    os.unlink(os.path.join(target, CLAIM))
    fsync_dir(target)


def _claim(target: str) -> dict[str, object]:
    """The claim of a publication beside other files into ``target`` that has not finished ({} if none)."""
    try:
        with open(os.path.join(target, CLAIM), "rb") as f:
            doc = claim_fields(f.read())
    except OSError:
        return {}
    return doc if re.fullmatch(r"[0-9a-f]{32}", doc.get("save_id", "")) else {}


def merging(target: str) -> str | None:
    """The save whose publication beside other files in ``target`` has not finished, if any."""
    return _claim(target).get("save_id")  # type: ignore[return-value]


def finish_merge(target: str) -> str | None:
    """Finish a publication beside other files that died after its claim went down (its checkpoint was complete
    in its staging directory before the claim); returns the save id published. A running one is left alone."""
    claim = _claim(target)
    save_id = claim.get("save_id")
    if not isinstance(save_id, str):
        return None
    staging, aside = staging_path(target, save_id), staging_path(target, save_id, old=True)
    if liveness(staging) is True:
        return None
    root = read_root(target)
    if root is None or describe_root(root).save_id != save_id:
        if read_root(staging) is None:  # neither here nor staged: not a claim of this protocol's
            return None
        old_own = root_keys(target) if root is not None else root_keys(aside)
        _complete_merge(target, staging, aside, save_id, old_own, aside_done=bool(claim.get("aside")))
    else:
        os.unlink(os.path.join(target, CLAIM))
        fsync_dir(target)
    for tree in (aside, staging):
        with contextlib.suppress(OSError):
            remove_tree(tree)
    return save_id
