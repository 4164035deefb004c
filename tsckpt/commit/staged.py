"""Publishing a save staged in a hidden directory on a local filesystem: renames, locks, leftovers.

The coordinator holds an exclusive ``flock`` on the staging directory for the whole save, so a running save's
directory is told from a dead one's. Publication is one rename, an exchange with the checkpoint it replaces, two
renames where the exchange is unsupported (:func:`recover` finishes one that died between them), or a merge
beside other files (:mod:`tsckpt.commit.merge`); see ``docs/publication.md``, step 5.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time

import tensorstore as ts

from ..errors import ConcurrentSaveError, StorageError
from ..storage.context import make_context, open_kvstore
from ..storage.localfs import DirLock, Turn, exchange, fsync_dir, liveness
from ..storage.location import Location
from ..wording import human_bytes
from .merge import finish_merge, merge, merging
from .staging_dirs import (committed, remove_tree, root_keys, settle, staging_dirs, staging_path, target_path,
                           tree_bytes)
from .states import ABSENT, COMMITTED, FILE, ROOT, Found, classify, refuse
from .target import Leftover, SaveTarget, warn_committed


class StagedTarget(SaveTarget):
    """A save into a local directory: staged beside it, published by rename or exchange."""

    #: Whether to publish over a checkpoint with ``RENAME_EXCHANGE``; where it is unsupported, or this is False,
    #: the two-rename sequence is used instead.
    use_exchange = True

    def __init__(self, location: Location, save_id: str, overwrite: bool):
        super().__init__(location, save_id, overwrite)
        self.path = target_path(location)
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
            problems.append(f"its publication may not survive a power loss (fsync of {parent} failed: {e.strerror})")
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
            with Turn(self.path) as turn:
                if not turn:
                    continue  # the target went, or was replaced, while this save waited for its turn
                finish_merge(self.path)  # a publication beside other files that died here, first
                found = self._found()
                if found.state == ABSENT and not found.others:
                    continue
                refuse(found, self.url, overwrite=self.overwrite, save_id=self.save_id, at_commit=True)
                if found.others:  # never moved, exchanged or renamed aside: the new files go in beside them
                    old_own = root_keys(self.path) if found.state == COMMITTED else None
                    return replaced + merge(self.staging, self.path, self.save_id, old_own, self.url)
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

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def abort(self) -> str | None:
        """Remove the staging directory while this save's lock still marks it as its own; None when it is gone,
        else where it is, its size and the command that removes it."""
        if merging(self.path) == self.save_id:
            # Its publication beside other files had begun: the replaced checkpoint may be aside and the
            # new one half moved in. Only going forward restores a checkpoint there (finish_merge).
            self.release()
            return f"its publication into {self.path} did not finish: `tsckpt clean {self.url}` finishes it"
        if os.path.isdir(self.staging) and self._lock is not None:
            remove_tree(self.staging)
        self.release()
        return self._left()

    def abort_interrupted(self) -> str | None:
        """:meth:`abort` after Ctrl-C: first wait for the writes interrupted ranks left landing in the staging
        directory, and remove what they write after the removal once more (no other save writes there)."""
        if merging(self.path) == self.save_id:  # its publication had begun: only going forward helps
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


def recover(target: str) -> str | None:
    """Finish a publication that died between its two renames, or beside other files; the save id published."""
    if os.path.isdir(target):
        with Turn(target) as turn:
            return finish_merge(target) if turn else None
    if os.path.lexists(target):
        return None
    for d in staging_dirs(target):
        new = staging_path(target, d.save_id)
        found = committed(new) if d.old else None
        if found is not None and found.save_id == d.save_id and liveness(new) is False:
            try:
                os.rename(new, target)
            except OSError:
                return None
            fsync_dir(os.path.dirname(target))
            return d.save_id
    return None


def find_leftovers(loc: Location) -> list[Leftover]:
    target = target_path(loc)
    out = []
    for d in staging_dirs(target):
        if d.old:
            # Filled while its save publishes beside other files: that save's until it is done.
            live: bool | None = merging(target) == d.save_id and liveness(staging_path(target, d.save_id)) is True
            what = f"the checkpoint replaced by save {d.save_id}, not yet deleted"
        else:
            live = liveness(d.path)
            found = committed(d.path)
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
    ``older_than`` (a ``time.time()``) spares directories modified since: a starting save may not hold its lock
    yet."""
    recover(target_path(loc))
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
