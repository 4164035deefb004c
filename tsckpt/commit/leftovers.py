"""What saves into a local target that did not finish left beside it: finishing their publication, listing
and removing their directories, and what to tell a reader who finds them."""

from __future__ import annotations

import os

from ..storage.localfs import Turn, fsync_dir, liveness
from ..storage.location import Location
from .merge import finish_merge, merging
from .staging_dirs import committed, remove_tree, staging_dirs, staging_path, target_path, tree_bytes
from .target import Leftover


def recover(target: str) -> str | None:
    """Finish a publication that died between its two renames, or beside other files (:func:`finish_merge`);
    returns the save id published, if any."""
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

    ``older_than`` (a ``time.time()``) spares directories modified since: a save
    starting at this moment has created its directory but may not hold its lock yet.
    """
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
