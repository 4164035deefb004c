"""Packed checkpoints that keep chunks of a base: the join starts from a hard-linked copy of the base's database.

OCDBT copies by reference only from a database below the target's own
directory, so the join cannot refer to a sibling checkpoint's data files.
Instead, when an incremental save in the packed layout keeps chunks of its
base (:mod:`tsckpt.base_chunks`), the coordinator, before joining:

1. hard-links the base's OCDBT files into the new checkpoint under the same
   names (``d/<hex>``, ``ocdbt.process_<r>/d/<hex>``; the names are random, so
   they never meet the new save's own) and copies its ``manifest.ocdbt``, so
   that the new root database starts as the base's;
2. deletes from it every key but the chunks kept, and commits that;
3. joins the ranks' databases and writes the node documents as for any save
   (:meth:`~tsckpt.storage.packed.PackedLayout.join`);
4. after that commit, unlinks every linked file the new database does not
   refer to, found by walking its B+tree (``ts.ocdbt.dump``).

The kept chunks' references keep their relative names, so a chain of
incremental saves never nests paths, and each checkpoint holds links to
exactly the data files it reads: deleting the base leaves it whole. Files are
never written in place (OCDBT writes new files; TensorStore's file driver
replaces a file by renaming a new one over it), so no checkpoint can change
another through a shared file.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

import tensorstore as ts

from .kvio import storage_error
from .location import Location

MANIFEST = "manifest.ocdbt"


@dataclass(frozen=True)
class KeptChunks:
    """The chunks of ``base`` (a committed packed checkpoint) that the new one keeps, by key."""

    base: Location
    keys: tuple[str, ...]

    @property
    def path(self) -> str:
        return str(self.base.spec.get("path", "")).rstrip("/")


def mirror(base: str, into: str) -> list[str]:
    """Link the base's OCDBT files into ``into`` under their own names; returns the names linked."""
    linked = []
    for folder, _, files in os.walk(base):
        rel = os.path.relpath(folder, base)
        for name in files:
            key = os.path.normpath(os.path.join(rel, name))
            if not _is_database_file(key):
                continue
            dest = os.path.join(into, key)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            if key == MANIFEST:
                shutil.copyfile(os.path.join(base, key), dest)  # rewritten by the join: never share it
            else:
                os.link(os.path.join(base, key), dest)
                linked.append(key)
    return linked


def _is_database_file(key: str) -> bool:
    parts = key.split(os.sep)
    return key == MANIFEST or (len(parts) == 2 and parts[0] == "d") or (
        len(parts) == 3 and parts[0].startswith("ocdbt.process_") and parts[1] == "d")


def keep_only(db: ts.KvStore, keys: tuple[str, ...], where: str) -> None:
    """Delete every key of ``db`` but ``keys`` (sorted), as one committed batch.

    Committed on its own: TensorStore 0.1.86 loses values copied into a
    transaction that also deletes ranges.
    """
    txn = ts.Transaction(atomic=False)
    view = db.with_transaction(txn)
    start = ""
    try:
        for key in keys:
            view.delete_range(ts.KvStore.KeyRange(start, key)).result()
            start = key + "\0"
        view.delete_range(ts.KvStore.KeyRange(start, "")).result()
        txn.commit_async().result()
    except ValueError as e:
        raise storage_error(e, f"preparing the database of {where} from its base failed") from None


def drop_unreferenced(into: str, linked: list[str], context: ts.Context) -> None:
    """Unlink the linked files the committed database at ``into`` does not refer to."""
    used = referenced_files(ts.KvStore.open({"driver": "file", "path": into + "/"}, context=context).result())
    for key in linked:
        if key.replace(os.sep, "/") not in used:
            os.unlink(os.path.join(into, key))


def referenced_files(base: ts.KvStore) -> set[str]:
    """The files the newest version of the OCDBT database in ``base`` reads: its B+tree, values, version tree."""
    manifest = ts.ocdbt.dump(base).result()
    # Old versions' B+trees are never read again: only the version tree's own nodes are kept for them.
    pending = [node["location"] for node in manifest.get("version_tree_nodes", [])]
    root = manifest["versions"][-1]["root"].get("location") if manifest["versions"] else None
    pending += [root] if root else []
    used: set[str] = set()
    while pending:
        location = pending.pop()
        used.add(_file(location))
        kind = location.split(":", 1)[0] + ":"
        for entry in ts.ocdbt.dump(base, location).result().get("entries", []):
            if "indirect_value" in entry:
                used.add(_file(entry["indirect_value"]))
            elif str(entry.get("location", "")).startswith(kind):  # a child of the same tree
                pending.append(entry["location"])
    return used


def _file(location: str) -> str:
    """The file of a dumped location ``<kind>:<base path>:<relative path>:<offset>:<length>``."""
    _, base_path, rest = location.split(":", 2)
    return base_path + rest.rsplit(":", 2)[0]
