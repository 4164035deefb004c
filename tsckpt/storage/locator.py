"""Where a committed checkpoint's values are: what a layout's locator answers (:meth:`KvLayout.locator
<tsckpt.storage.layouts.KvLayout.locator>`): :meth:`Locator.prefetch` with every key a read needs, then
:meth:`Locator.locate` for each.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import tensorstore as ts

if TYPE_CHECKING:
    from .rank_tables import RankTables

#: Reads ``(file, offset, length)`` spans, all at once, merged by the reader's cost model: their bytes, in order.
ReadSpans = Callable[[Sequence[tuple[str, int, int]]], list[np.ndarray]]


@dataclass(frozen=True)
class Located:
    """Where a key's value is: ``length`` bytes (None: the whole file) at ``offset`` of file ``file``,
    relative to the checkpoint, or ``inline`` bytes (the value itself)."""

    file: str
    offset: int = 0
    length: int | None = None
    inline: bytes | None = None


class Locator(ABC):
    """A committed checkpoint's keys, as a reader finds them (see :meth:`KvLayout.locator`)."""

    #: The kvstore files are read from: the location's own.
    kvstore: ts.KvStore

    @abstractmethod
    def locate(self, key: str) -> Located | None:
        """Where ``key`` (relative to the checkpoint) is stored; None if the checkpoint has no such key."""

    def prefetch(self, keys: Iterable[str]) -> None:
        """Find ``keys`` together, so that each :meth:`locate` of them after reads nothing more. A failed lookup is
        raised by :meth:`locate` of each key it was for, never here."""

    def bind(self, read: ReadSpans, whole_up_to: int, tables: RankTables | None = None) -> None:
        """Read what locating needs (``tables``, index nodes) through ``read``, merged with the reader's other
        ranges (a table or index of at most ``whole_up_to`` bytes whole)."""

    def everything(self) -> Mapping[str, Located]:
        """Every key of an index and where its value is, every node read and checked (``verify``)."""
        return {}

    def sizes(self) -> Mapping[str, int]:
        """Files whose size is known from the root document: a file of another size is damaged."""
        return {}

    def generations(self) -> Mapping[str, bytes]:
        """Objects whose generation (ETag) the root document records: read as another generation, damaged."""
        return {}
