"""Publishing a save staged in a hidden directory on a local filesystem: renames, locks, leftovers.

Every save into ``<parent>/<name>`` writes into ``<parent>/.<name>.tsckpt-<save_id>``
and commits there. The coordinator holds an exclusive ``flock`` on that
directory for the whole save, so any process can tell a running save's
staging directory from a dead one's. Publication is one atomic step:

* ``rename(staging, target)`` when the target is absent or an empty directory
  (it fails, atomically, if another save published first);
* ``renameat2(RENAME_EXCHANGE)`` when replacing a committed checkpoint: both
  trees swap in one step, so readers see the old checkpoint until the new one
  is complete; the old tree, now under the staging name, is deleted after;
* where the exchange is not supported (not Linux, or a filesystem without it),
  the target is first renamed aside to ``.<name>.tsckpt-<save_id>.old``, then
  the staging directory into place. Between the two renames the target is
  absent; if the save dies there, :func:`recover` (run by the next save into the
  target and by ``tsckpt clean``) publishes the new checkpoint, which was
  complete before the first rename.
* when the target holds other files (a run directory's configs and logs), the
  directory itself is never moved: the save puts a claim, ``.tsckpt-claim.json``,
  into it, moves the checkpoint it replaces (its root document first, then
  the files that checkpoint names) into ``.<name>.tsckpt-<save_id>.old``, moves
  its own files in (whole directories where the target has none of that
  name), renames its root document in last, and removes the claim. Between
  the first and the last rename no checkpoint loads there; if the save dies,
  :func:`finish_merge` (run by the next save and by ``tsckpt clean``) goes on
  from where it stopped. Nothing of the other files is moved, replaced or
  deleted; a file standing where the save's files go refuses the publication
  before anything moves.

Publications into one target take turns (an exclusive ``flock`` on it). The
parent directory is fsynced after each publication.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import tensorstore as ts

from ..errors import ConcurrentSaveError, FileInTheWayError, StorageError
from ..storage.context import make_context, open_kvstore
from ..storage.localfs import UNSUPPORTED, DirLock, exchange, fsync_dir, liveness
from ..storage.location import Location
from .states import (ABSENT, CLAIM, COMMITTED, FILE, ROOT, Found, checkpoint_keys, classify, describe_root,
                     is_own_key, refuse)
from .target import Leftover, SaveTarget, warn_committed
from ..wording import human_bytes

#: The name of a save's staging directory, or of a checkpoint it replaced, beside the target ``name``.
STAGING_NAME = re.compile(r"^\.(?P<name>.+)\.tsckpt-(?P<save_id>[0-9a-f]{32})(?P<old>\.old)?$")


def staging_path(target: str, save_id: str, *, old: bool = False) -> str:
    parent, name = os.path.split(target)
    return os.path.join(parent, f".{name}.tsckpt-{save_id}" + (".old" if old else ""))


def remove_tree(path: str, own: Callable[[str], bool] | None = None) -> None:
    """Delete a staged or replaced checkpoint: its root document first, so no half-deleted tree is committed.

    Only files a tsckpt save may have written go: those the committed root
    document names (:func:`~tsckpt.commit.states.checkpoint_keys`), or ``own``,
    or by their names (:func:`~tsckpt.commit.states.is_own_key`) in a tree
    that never committed. Anything else, and the directories holding it,
    stay where they are.
    """
    if own is None:
        try:
            with open(os.path.join(path, ROOT), "rb") as f:
                own = checkpoint_keys(f.read())
        except OSError:
            pass
    own = own or is_own_key
    try:
        os.unlink(os.path.join(path, ROOT))
    except (FileNotFoundError, NotADirectoryError):
        pass
    for top, dirs, files in os.walk(path, topdown=False):
        for name in files:
            full = os.path.join(top, name)
            if own(os.path.relpath(full, path).replace(os.sep, "/")):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(full)
        with contextlib.suppress(FileNotFoundError, OSError):
            os.rmdir(top)  # fails, as it should, where something tsckpt did not write remains


def tree_bytes(path: str) -> int:
    total = 0
    for root, dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except FileNotFoundError:
                pass
    return total


def _tree_state(path: str) -> tuple[int, int, int]:
    """Files, bytes and the newest modification time under ``path``: what changes while writes land."""
    files = nbytes = newest = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                st = os.lstat(os.path.join(root, name))
            except FileNotFoundError:
                continue
            files, nbytes, newest = files + 1, nbytes + st.st_size, max(newest, st.st_mtime_ns)
    return files, nbytes, newest


def settle(path: str, *, quiet: float = 0.25, limit: float = 10.0) -> None:
    """Wait until nothing under ``path`` has changed for ``quiet`` seconds, or ``limit`` seconds have passed.

    A rank stopped by Ctrl-C leaves the writes it had started running in the
    background (write threads, TensorStore's own): a staging directory removed
    before they end would be made again by the files they create after it.
    """
    deadline = time.monotonic() + limit
    last, calm_since = _tree_state(path), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = _tree_state(path)
        if now != last:
            last, calm_since = now, time.monotonic()
        elif time.monotonic() - calm_since >= quiet:
            return


def _committed(path: str) -> Found | None:
    """What the root document under ``path`` says, if it commits a checkpoint."""
    try:
        with open(os.path.join(path, ROOT), "rb") as f:
            found = describe_root(f.read())
    except OSError:
        return None
    return found if found.state == COMMITTED else None


def _is_complete(path: str) -> bool:
    return _committed(path) is not None


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
    out = []
    for entry in sorted(entries):
        m = STAGING_NAME.match(entry)
        if m and m["name"] == name:
            out.append(StagingDir(os.path.join(parent, entry), m["save_id"], bool(m["old"])))
    return out


def recover(target: str) -> str | None:
    """Finish a publication that died between its two renames, or beside other files (:func:`finish_merge`);
    returns the save id published, if any."""
    if os.path.isdir(target):
        with _Turn(target) as turn:
            return finish_merge(target) if turn else None
    if os.path.lexists(target):
        return None
    for d in staging_dirs(target):
        new = staging_path(target, d.save_id)
        found = _committed(new) if d.old else None
        if found is not None and found.save_id == d.save_id and liveness(new) is False:
            try:
                os.rename(new, target)
            except OSError:
                return None
            fsync_dir(os.path.dirname(target))
            return d.save_id
    return None


def find_leftovers(loc: Location) -> list[Leftover]:
    target = _target_path(loc)
    out = []
    for d in staging_dirs(target):
        if d.old:
            # Filled while its save publishes beside other files: that save's until it is done.
            live: bool | None = _merging(target) == d.save_id and liveness(staging_path(target, d.save_id)) is True
            what = f"the checkpoint replaced by save {d.save_id}, not yet deleted"
        else:
            live = liveness(d.path)
            found = _committed(d.path)
            if found is None:
                what = f"staging directory of save {d.save_id}"
            elif found.save_id == d.save_id:
                what = f"staging directory of save {d.save_id} (complete, not published)"
            else:  # after an exchange the replaced checkpoint sits under the staging name
                what = f"the checkpoint replaced by save {d.save_id}, not yet deleted"
        out.append(Leftover(d.path, tree_bytes(d.path), live, what))
    return out


def remove_leftovers(loc: Location, *, force: bool = False, older_than: float | None = None) -> list[Leftover]:
    """Finish an interrupted publication, then remove dead saves' directories (``force``: unknown ones too).

    ``older_than`` (a ``time.time()``) spares directories modified since: a save
    starting at this moment has created its directory but may not hold its lock yet.
    """
    recover(_target_path(loc))
    removed = []
    for item in find_leftovers(loc):
        if not (item.live is False or (force and item.live is None)):
            continue
        try:
            if older_than is not None and os.stat(item.path).st_mtime >= older_than:
                continue
        except FileNotFoundError:
            continue
        remove_tree(item.path)
        removed.append(item)
    return removed


def hint(path: str) -> str:
    """What to tell a reader that finds nothing at ``path`` but staging directories beside it."""
    dirs = staging_dirs(os.path.realpath(path))
    if not dirs:
        return ""
    complete = [d for d in dirs if not d.old and _is_complete(d.path)]
    if complete and any(d.old for d in dirs):
        return (f"; a publication that did not finish left the new checkpoint in {complete[0].path}: "
                f"`tsckpt clean {path}` finishes it")
    many = len(dirs) != 1
    return (f"; {len(dirs)} leftover staging director{'ies' if many else 'y'} of saves that did not finish "
            f"{'are' if many else 'is'} beside it (`tsckpt clean {path}` removes dead ones)")


class _Turn:
    """An exclusive ``flock`` on the target directory, waited for: publications into it take turns.

    False (retry) when the target went or was replaced while waiting; True
    without a lock where the filesystem has none, or the target is not a
    directory (the classification then refuses it).
    """

    def __init__(self, path: str):
        self.path, self.fd = path, -1

    def __enter__(self) -> bool:
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            return False
        except NotADirectoryError:
            return True
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except OSError as e:
            if e.errno not in UNSUPPORTED:
                raise
            return True
        try:
            here, now = os.fstat(self.fd), os.stat(self.path)
        except FileNotFoundError:
            return False
        return (here.st_dev, here.st_ino) == (now.st_dev, now.st_ino)

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # releases the lock
            self.fd = -1


def _read_root(path: str) -> bytes | None:
    try:
        with open(os.path.join(path, ROOT), "rb") as f:
            return f.read()
    except (FileNotFoundError, NotADirectoryError):
        return None


def _root_keys(path: str) -> Callable[[str], bool] | None:
    """Which files belong to the checkpoint whose root document is in ``path`` (None: no root)."""
    raw = _read_root(path)
    if raw is None:
        return None
    return checkpoint_keys(raw) or is_own_key


def _files(path: str) -> list[str]:
    """Every file under ``path``, relative to it, with "/" between names."""
    out = []
    for top, _, names in os.walk(path):
        rel = os.path.relpath(top, path).replace(os.sep, "/")
        out += [name if rel == "." else f"{rel}/{name}" for name in names]
    return out


def _in_the_way(staging: str, target: str, old_own: Callable[[str], bool] | None, rel: str = "") -> list[str]:
    """What in ``target`` stands where a file or directory of ``staging`` goes (the replaced checkpoint's own
    files, which go aside first, do not). Only directories both hold are looked into."""
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
    if new:
        with open(os.path.join(target, CLAIM), "x") as f:
            json.dump(doc, f)
            f.flush()
            os.fsync(f.fileno())
    else:
        draft = os.path.join(aside, CLAIM)
        with open(draft, "w") as f:
            json.dump(doc, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(draft, os.path.join(target, CLAIM))
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
            doc = json.loads(f.read())
    except (OSError, ValueError):
        return {}
    save_id = doc.get("save_id") if isinstance(doc, dict) else None
    return doc if isinstance(save_id, str) and re.fullmatch(r"[0-9a-f]{32}", save_id) else {}


def _merging(target: str) -> str | None:
    """The save whose publication beside other files in ``target`` has not finished, if any."""
    return _claim(target).get("save_id")  # type: ignore[return-value]


def finish_merge(target: str) -> str | None:
    """Finish a publication beside other files that died after its claim went down; the save id published.

    Its checkpoint was complete in its staging directory before the claim:
    the replaced checkpoint's files still in the target go aside, the rest of
    the new one goes in, and its root last. A running one is left alone.
    """
    claim = _claim(target)
    save_id = claim.get("save_id")
    if not isinstance(save_id, str):
        return None
    staging, aside = staging_path(target, save_id), staging_path(target, save_id, old=True)
    if liveness(staging) is True:
        return None
    root = _read_root(target)
    if root is None or describe_root(root).save_id != save_id:
        if _read_root(staging) is None:  # neither here nor staged: not a claim of this protocol's
            return None
        old_own = _root_keys(target) if root is not None else _root_keys(aside)
        _complete_merge(target, staging, aside, save_id, old_own, aside_done=bool(claim.get("aside")))
    else:
        os.unlink(os.path.join(target, CLAIM))
        fsync_dir(target)
    for tree in (aside, staging):
        with contextlib.suppress(OSError):
            remove_tree(tree)
    return save_id


def _target_path(loc: Location) -> str:
    return os.path.realpath(str(loc.spec.get("path", "")).rstrip("/") or "/")


class StagedTarget(SaveTarget):
    """A save into a local directory: staged beside it, published by rename or exchange."""

    #: Whether to publish over a checkpoint with ``RENAME_EXCHANGE``; where it is
    #: unsupported, or this is False, the two-rename sequence is used instead.
    use_exchange = True

    def __init__(self, location: Location, save_id: str, overwrite: bool):
        super().__init__(location, save_id, overwrite)
        self.path = _target_path(location)
        self.staging = staging_path(self.path, save_id)
        self._lock: DirLock | None = None

    @property
    def data_location(self) -> Location:
        return Location({**self.location.spec, "path": self.staging + "/"}, self.location.context)

    def _found(self) -> Found:
        if os.path.lexists(self.path) and not os.path.isdir(self.path):
            return Found(FILE, "a file, not a directory")
        kv = open_kvstore(self.location, make_context(location=self.location))
        return classify(kv, self.url, inside=self.overwrite)

    def begin(self) -> None:
        started = time.time()
        parent = os.path.dirname(self.path)
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as e:
            raise StorageError(f"cannot create checkpoint {self.url}: {e.strerror} ({e.filename})") from None
        recover(self.path)
        refuse(self._found(), self.url, overwrite=self.overwrite, save_id=self.save_id)
        remove_leftovers(self.location, older_than=started)
        self._make_staging()

    def _make_staging(self) -> None:
        for _ in range(5):
            try:
                os.mkdir(self.staging)
                lock = DirLock.try_acquire(self.staging)
            except FileNotFoundError:
                continue  # another save's cleaning took it in the instant before it was locked
            except FileExistsError:
                time.sleep(0.1)  # that cleaning is still removing it
                continue
            except OSError as e:
                raise StorageError(f"cannot create staging directory {self.staging} for {self.url}: "
                                  f"{e.strerror}") from None
            if lock is None:  # no locks on this filesystem: leftovers are only reported
                return
            if isinstance(lock, DirLock) and lock.still_linked:
                self._lock = lock
                return
            if isinstance(lock, DirLock):
                lock.release()
        raise StorageError(f"cannot create and lock staging directory {self.staging} for {self.url}")

    def commit_root(self, kv: ts.KvStore, root: bytes) -> None:
        kv.write(ROOT, root).result()
        fsync_dir(self.staging)
        try:
            replaced = self._publish()
        except OSError as e:
            raise StorageError(f"publishing {self.url} failed: {e}") from None
        # Published: the checkpoint is committed, and whatever fails from here on is said as such.
        problems = []
        parent = os.path.dirname(self.path)
        try:
            fsync_dir(parent)
        except OSError as e:
            problems.append(f"its publication may not survive a power loss (fsync of {parent} failed: "
                            f"{e.strerror})")
        self.release()
        for old in replaced:
            why = ""
            try:
                remove_tree(old)
            except OSError as e:
                why = f" ({e.strerror}: {e.filename})"
            if os.path.lexists(old):
                problems.append(f"the checkpoint it replaced is left at {old} ({human_bytes(tree_bytes(old))}){why}: "
                                f"`tsckpt clean {self.url}` removes it")
        if problems:
            warn_committed(self.url, self.save_id, problems)

    def _publish(self) -> list[str]:
        """Move the committed staging directory to the target; returns old trees to delete."""
        replaced: list[str] = []
        for _ in range(5):
            try:
                os.rename(self.staging, self.path)  # the target is absent or an empty directory
                return replaced
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                    if replaced:  # not published: the checkpoint moved aside goes back, or it would be a leftover
                        with contextlib.suppress(OSError):
                            os.rename(replaced[-1], self.path)
                    raise
            with _Turn(self.path) as turn:
                if not turn:
                    continue  # the target went, or was replaced, while this save waited for its turn
                finish_merge(self.path)  # a publication beside other files that died here, first
                found = self._found()
                if found.state == ABSENT and not found.others:
                    continue
                refuse(found, self.url, overwrite=self.overwrite, save_id=self.save_id, at_commit=True)
                if found.others:  # never moved, exchanged or renamed aside: the new files go in beside them
                    return replaced + self._merge(found)
                if found.state == COMMITTED and self.use_exchange and exchange(self.staging, self.path):
                    # The old checkpoint now sits under the staging name; nobody holds a lock on it.
                    return replaced + [self.staging]
                aside = staging_path(self.path, self.save_id, old=True)
                try:
                    os.rename(self.path, aside)
                except FileNotFoundError:
                    continue
                replaced.append(aside)
        raise ConcurrentSaveError(f"{self.url} kept changing while save {self.save_id} was being published; "
                          f"it was not published")

    def _merge(self, found: Found) -> list[str]:
        """Publish into a target that holds other files, beside them (module docstring); returns the trees
        left to delete: the replaced checkpoint's files, moved aside, and the emptied staging directory."""
        old_own = _root_keys(self.path) if found.state == COMMITTED else None
        in_the_way = _in_the_way(self.staging, self.path, old_own)
        if in_the_way:
            raise FileInTheWayError(
                f"{self.url} holds {in_the_way[0]!r} where save {self.save_id} writes its own files; it was not "
                f"published (tsckpt never writes over what it did not write): move that file, or save elsewhere")
        aside = staging_path(self.path, self.save_id, old=True)
        # Marks the target as being published into, for finish_merge.
        _put_claim(self.path, aside, {"save_id": self.save_id, "publishing": True}, new=True)
        _complete_merge(self.path, self.staging, aside, self.save_id, old_own, aside_done=False)
        return [aside, self.staging]

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def abort(self) -> str | None:
        """Remove the staging directory while this save's lock still marks it as this save's own.

        Returns None when it is gone, else where it is, its size and the
        command that removes it (a filesystem without locks, or files that
        are not a save's).
        """
        if _merging(self.path) == self.save_id:
            # Its publication beside other files had begun: the replaced checkpoint may be aside and the
            # new one half moved in. Only going forward restores a checkpoint there (finish_merge).
            self.release()
            return (f"its publication into {self.path} did not finish: `tsckpt clean {self.url}` "
                    f"finishes it")
        if os.path.isdir(self.staging) and self._lock is not None:
            remove_tree(self.staging)
        self.release()
        return self._left()

    def abort_interrupted(self) -> str | None:
        """:meth:`abort` after Ctrl-C: first wait for the writes still landing in the staging directory.

        Interrupted ranks do not wait for the writes they started; what those
        write after the removal is removed once more (the directory carries
        this save's id: no other save writes there). Returns as :meth:`abort`.
        """
        if _merging(self.path) == self.save_id:  # its publication had begun: only going forward helps
            return self.abort()
        settle(self.staging)
        self.abort()
        settle(self.staging, quiet=0.2, limit=2.0)
        if os.path.isdir(self.staging):
            remove_tree(self.staging)
        return self._left()

    def _left(self) -> str | None:
        if not os.path.lexists(self.staging):
            return None
        return (f"{self.staging} ({human_bytes(tree_bytes(self.staging))}) is left: "
                f"`tsckpt clean {self.url}` removes it")

    @classmethod
    def leftovers(cls, location: Location) -> list[Leftover]:
        return find_leftovers(location)

    @classmethod
    def clean(cls, location: Location, *, force: bool) -> list[Leftover]:
        return remove_leftovers(location, force=force)
