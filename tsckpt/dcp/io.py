"""What the DCP writer and reader share: a checkpoint location opened lazily, and DCP's future type.

TensorStore handles do not pickle, and ``dcp.async_save``'s process mode pickles
the writer, so the store is made on first use and dropped when pickled.
"""

from __future__ import annotations

import time
from typing import Any

import tensorstore as ts
from torch.futures import Future

from ..errors import LocationError, TsckptError
from ..storage.store import Store
from ..storage.location import Location, LocationLike, parse_location


def done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


class TensorStoreIO:
    """What the writer and reader share: a location and, made on first use, its :class:`Store`."""

    def __init__(self, path: LocationLike | None, io_concurrency: int):
        self.location: Location | None = parse_location(path) if path is not None else None
        self.io_concurrency = io_concurrency
        self._store: Store | None = None
        self._started = time.perf_counter()

    @property
    def checkpoint_id(self) -> str | None:
        return self.location.url if self.location else None

    def _reset(self, checkpoint_id: LocationLike | None) -> None:
        if checkpoint_id is not None:
            location = parse_location(checkpoint_id)
            if location != self.location:
                self.location, self._store = location, None
        if self.location is None:
            raise LocationError("no checkpoint location: pass a path to the constructor or checkpoint_id=")

    @property
    def store(self) -> Store:
        if self._store is None:
            assert self.location is not None
            self._store = self._open_store(self.location)
        return self._store

    def _open_store(self, location: Location) -> Store:
        return Store.open(location, io_concurrency=self.io_concurrency)

    @property
    def context(self) -> ts.Context:
        return self.store.context

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_store": None, "_target": None, "_data_store": None}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: LocationLike) -> bool:
        try:
            parse_location(checkpoint_id)
        except TsckptError:
            return False
        return True
