"""One save's target: where its data goes and how its root document becomes visible; leftovers of dead saves.

Local filesystems stage and rename (:mod:`tsckpt.commit.staged`); object stores and memory write in place
under a claim (:mod:`tsckpt.commit.in_place`). The protocol is ``docs/publication.md``.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import tensorstore as ts

from ..storage.location import Location


class PublicationWarning(UserWarning):
    """A save is committed, but something after its commit could not be done; the message says what is left
    where, and the command that removes it."""


def warn_committed(url: str, save_id: str, problems: Sequence[str]) -> None:
    """Say that save ``save_id`` is committed at ``url`` although ``problems`` happened after its commit."""
    warnings.warn(f"{url}: save {save_id} is committed, but {'; and '.join(problems)}", PublicationWarning,
                  stacklevel=2)


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
        self.location, self.save_id, self.overwrite = location, save_id, overwrite

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
        """Coordinator, before the commit writes anything shared: raise if another save has overtaken this one."""

    def begin_commit(self) -> None:
        """Coordinator, once every rank's data is durable and before any node is written: raise if this save
        can no longer commit, and from here on keep other saves from taking the location over."""
        self.check_current()

    #: Key prefixes under :attr:`data_location` that this save's ranks write before its commit.
    written: tuple[str, ...] = ()

    def record_writes(self, prefixes: tuple[str, ...]) -> None:
        """Coordinator, before any rank writes: where the data will go, for :meth:`abort` to remove."""
        self.written = tuple(prefixes)

    def abort(self) -> str | None:
        """Best effort, after a failure: drop what only this save used; None when it is gone, else what is left."""
        return None

    @classmethod
    @abstractmethod
    def leftovers(cls, location: Location) -> list[Leftover]:
        """What saves into ``location`` that did not finish left there (running ones marked live)."""

    @classmethod
    @abstractmethod
    def clean(cls, location: Location, *, force: bool) -> list[Leftover]:
        """Remove dead saves' leftovers (``force``: also those that may belong to a running save)."""


