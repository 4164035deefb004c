"""A B+tree's sorted keys in columns, with no Python object per key. An index's keys (``<array path>/c.<i>.<j>``)
are mostly runs that differ only in their chunk index, and every array of one chunk grid has the same tails:
they are sorted and prefix-coded once per grid (:class:`Tails`), each array's keys are its path followed by
them (:class:`KeyRun`), and a leaf's key columns are slices of the whole index's (:class:`SortedKeys`)."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .ocdbt_records import sorted_prefix_lengths


class Tails:
    """Sorted, distinct key tails, prefix-coded: each tail's common prefix with the one before, and the rest."""

    def __init__(self, tails: Sequence[bytes]):
        self.tails = list(tails)
        self.prefix, bad = sorted_prefix_lengths(self.tails)
        if bad is not None:
            raise ValueError(f"key tails out of order or repeated: {self.tails[bad - 1]!r} before {self.tails[bad]!r}")
        self.length = np.fromiter(map(len, self.tails), np.int64, len(self.tails))
        #: The bytes of every tail after its common prefix with the one before, from the second tail on:
        #: tail ``k``'s at ``rest[rest_starts[k]:rest_starts[k + 1]]`` (none for the first).
        self.rest = np.frombuffer(b"".join(t[p:] for t, p in zip(self.tails[1:], self.prefix[1:].tolist())),
                                  np.uint8)
        self.rest_starts = np.zeros(len(self.tails) + 1, np.int64)
        np.cumsum((self.length - self.prefix)[1:], out=self.rest_starts[2:])

    def __len__(self) -> int:
        return len(self.tails)


#: The tail of a run of one key.
ONE = Tails([b""])


@dataclass(frozen=True)
class KeyRun:
    """Keys ``head + tail`` for every tail of ``tails``, in order."""

    head: bytes
    tails: Tails = ONE

    def first(self) -> bytes:
        return self.head + self.tails.tails[0]

    def last(self) -> bytes:
        return self.head + self.tails.tails[-1]


class SortedKeys:
    """Sorted, distinct keys made of :class:`KeyRun` runs, as the columns a B+tree leaf cuts its own from.

    ``prefix[k]``: key ``k``'s common prefix with key ``k - 1`` (0 for the first); ``length[k]``: its length;
    ``rest[starts[k]:starts[k + 1]]``: its bytes after that prefix (computed when first asked for: leaves of a
    whole run are cut from its :class:`Tails` instead). Raises ``ValueError`` if the runs are out of order."""

    def __init__(self, runs: Sequence[KeyRun]):
        self.runs = list(runs)
        sizes = np.fromiter((len(r.tails) for r in self.runs), np.int64, len(self.runs))
        self.run_starts = np.zeros(len(self.runs) + 1, np.int64)
        np.cumsum(sizes, out=self.run_starts[1:])
        #: Each run's first key's common prefix with the key before it.
        self.run_prefix = np.zeros(len(self.runs), np.int64)
        before = None
        for i, r in enumerate(self.runs):
            first = r.first()
            if before is not None:
                if not before < first:
                    raise ValueError(f"keys out of order or repeated: {before!r} before {first!r}")
                self.run_prefix[i] = len(os.path.commonprefix((before, first)))
            before = r.last()

    @functools.cached_property
    def _columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        prefixes, lengths, rests = [], [], []
        for r, p in zip(self.runs, self.run_prefix.tolist()):
            head = len(r.head)
            prefixes += [np.asarray([p], np.int64), r.tails.prefix[1:] + head]
            lengths.append(r.tails.length + head)
            rests += [np.frombuffer(r.first()[p:], np.uint8), r.tails.rest]
        prefix = np.concatenate(prefixes) if prefixes else np.zeros(0, np.int64)
        length = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        starts = np.zeros(len(length) + 1, np.int64)
        np.cumsum(length - prefix, out=starts[1:])
        return prefix, length, np.concatenate(rests) if rests else np.zeros(0, np.uint8), starts

    prefix = property(lambda self: self._columns[0])
    length = property(lambda self: self._columns[1])
    rest = property(lambda self: self._columns[2])
    starts = property(lambda self: self._columns[3])

    @classmethod
    def of(cls, keys: Sequence[bytes]) -> SortedKeys:
        """Keys given one by one (sorted, distinct)."""
        return cls([KeyRun(k) for k in keys])

    def __len__(self) -> int:
        return int(self.run_starts[-1])

    def key(self, k: int) -> bytes:
        """Key ``k``, whole."""
        r = int(np.searchsorted(self.run_starts, k, side="right")) - 1
        run = self.runs[r]
        return run.head + run.tails.tails[k - int(self.run_starts[r])]


def sorted_tails(tails: Sequence[bytes]) -> tuple[Tails, np.ndarray]:
    """``tails`` sorted as :class:`Tails`, and the permutation that sorts them (position in ``tails`` of each)."""
    order = sorted(range(len(tails)), key=tails.__getitem__)
    return Tails([tails[k] for k in order]), np.asarray(order, np.int64)
