"""Choosing how a save into a location is published, and the calls every caller makes on it.

:func:`begin_save` runs once per save, on its coordinator, before any data is
written; it refuses a committed checkpoint (unless overwriting) and content
tsckpt did not write, and removes leftovers of dead saves. The target's
:meth:`~tsckpt.commit.target.SaveTarget.commit_root` writes the root document
and publishes it, re-checking the refusals, since another save may have
committed meanwhile.
"""

from __future__ import annotations

from ..storage.location import Location, LocationLike, parse_location
from .in_place import InPlaceTarget
from .staged import StagedTarget
from .target import Leftover, SaveTarget

#: The target kind of each kvstore driver that can rename; every other driver is written in place.
TARGET_KINDS: dict[str, type[SaveTarget]] = {"file": StagedTarget}

def target_kind(location: Location) -> type[SaveTarget]:
    """The kind of target for a location's kvstore driver: staged where renames exist, in place elsewhere."""
    return TARGET_KINDS.get(location.driver, InPlaceTarget)


def begin_save(location: LocationLike, *, save_id: str, overwrite: bool,
               writes: tuple[str, ...] = ()) -> SaveTarget:
    """Start a save into ``location``: checks, fencing and leftover removal; returns its target.

    ``writes``: the key prefixes its ranks will write, where known before
    planning (:meth:`~tsckpt.commit.target.SaveTarget.record_writes`).
    """
    loc = parse_location(location)
    target = target_kind(loc)(loc, save_id, overwrite)
    target.written = tuple(writes)
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

