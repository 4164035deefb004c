"""Storage layouts: where a checkpoint's Zarr keys live under its location (arrays, grids and codecs are the
same in every layout). ``"packed"`` (the default): one OCDBT database over one data file per rank
(:mod:`tsckpt.storage.packed`); ``"plain"``: one file (or object) per chunk, which any Zarr v3 reader opens.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import tensorstore as ts

from ..errors import MetadataError, OptionError
from ..format.data_files import Span
from ..format.metadata import CheckpointMetadata
from . import packed, packed_index, sinks
from .context import OpenedLocation
from .kvio import storage_error
from .localfs import unsynced_nodes
from .location import Location
from .locator import Located, Locator, PackedLocator

PLAIN = "plain"
PACKED = "packed"
#: Environment variable naming the layout of saves that name none (``packed`` when unset).
LAYOUT_ENV = "TSCKPT_LAYOUT"


class KvLayout(ABC):
    """How a checkpoint's arrays and node documents map onto files or objects under its location."""

    name: ClassVar[str]

    @abstractmethod
    def array_kvstore(self, location: Location, path: str) -> dict[str, Any]:
        """The kvstore spec TensorStore finds the array (or group) at ``path`` in."""

    def context(self, parent: ts.Context) -> ts.Context:
        """The context every array of a location is opened with (a layout may add resources)."""
        return parent

    def sink(self, store: OpenedLocation, rank: int, save_id: str, *, sync: bool, hashed: bool) -> sinks.Sink:
        """Where rank ``rank`` stores its values in save ``save_id`` (``hashed``: taking their content hashes)."""
        return sinks.Sink.open(store.kvstore, _local_root(store.location), save_id, rank, packed=self.name == PACKED,
                               sync=sync, hashed=hashed, threads=store.io_concurrency)

    def bands(self, location: Location) -> bool:
        """Whether saves to ``location`` cut sharded tensors into bands stored band by band across tensors
        (:mod:`tsckpt.format.band_order`)."""
        return False

    @abstractmethod
    def rank_prefixes(self, paths: list[str], save_id: str) -> tuple[str, ...]:
        """The key prefixes ranks write under before the commit (what a failed save removes)."""

    def prefixes_before_planning(self, save_id: str) -> tuple[str, ...]:
        """:meth:`rank_prefixes`, where they do not depend on the arrays' paths (else none)."""
        return ()

    @abstractmethod
    def write_nodes(self, store: OpenedLocation, save_id: str, docs: Mapping[str, bytes],
                    values: packed.StoredValues | None,
                    fence: Callable[[], None]) -> tuple[Span | None, Callable[[], None] | None]:
        """Coordinator: store every array's and group's ``zarr.json`` (``docs``, by key) and, for layouts that
        index them, where every value is. Returns the index written (if any) and a call that makes it all durable,
        run before the root document is written. ``fence`` (:meth:`~tsckpt.commit.target.SaveTarget.begin_commit`)
        must return before any key that another save could also write is written."""

    @abstractmethod
    def locator(self, store: OpenedLocation, metadata: CheckpointMetadata) -> Locator:
        """Readers: how to find the keys of the committed checkpoint at ``store``."""

    def hierarchy(self, store: OpenedLocation) -> ts.KvStore:
        """A kvstore holding every key of a committed checkpoint but the root document, by full key."""
        return store.kvstore


def get_layout(name: str) -> KvLayout:
    try:
        return LAYOUTS[name]
    except KeyError:
        raise OptionError(f"unknown storage layout {name!r}; expected one of {sorted(LAYOUTS)}") from None


def default_layout() -> str:
    """The layout a save uses when it names none: ``$TSCKPT_LAYOUT``, else ``"packed"`` (in a multi-rank save the
    coordinator's, sent to every rank with the plan)."""
    name = os.environ.get(LAYOUT_ENV, "").strip() or PACKED
    if name not in LAYOUTS:
        raise OptionError(f"{LAYOUT_ENV}={name!r}: unknown storage layout; expected one of {sorted(LAYOUTS)}")
    return name


def layout_for(metadata: CheckpointMetadata) -> KvLayout:
    try:
        return LAYOUTS[metadata.layout]
    except KeyError:
        raise MetadataError(f"checkpoint metadata: unknown storage layout {metadata.layout!r}; "
                            f"expected one of {sorted(LAYOUTS)}") from None


def _local_root(location: Location) -> str | None:
    return str(location.spec.get("path", ".")) if location.driver == "file" else None


class _KeysAsFiles(Locator):
    def __init__(self, kv: ts.KvStore):
        self.kvstore = kv

    def locate(self, key: str) -> Located | None:
        return Located(key)


class PlainLayout(KvLayout):
    """Each array under its own path below the location: the Zarr hierarchy as files or objects."""

    name = PLAIN

    def array_kvstore(self, location: Location, path: str) -> dict[str, Any]:
        return location.child(path)

    def rank_prefixes(self, paths: list[str], save_id: str) -> tuple[str, ...]:
        return (*(f"{p}/" for p in paths), f"d/{save_id}")

    def write_nodes(self, store: OpenedLocation, save_id: str, docs: Mapping[str, bytes],
                    values: packed.StoredValues | None,
                    fence: Callable[[], None]) -> tuple[Span | None, Callable[[], None] | None]:
        fence()  # every document here is a key another save writes too
        fast = unsynced_nodes(store.location)
        kv, flush = fast if fast is not None else (store.kvstore, None)
        try:
            for f in [kv.write(key, doc) for key, doc in docs.items()]:
                f.result()
        except ValueError as e:
            raise storage_error(e, f"writing the array documents of {store.url} failed") from None
        return None, flush

    def locator(self, store: OpenedLocation, metadata: CheckpointMetadata) -> Locator:
        return _KeysAsFiles(store.kvstore)


class PackedLayout(KvLayout):
    """Every key in one OCDBT database over one data file per rank (:mod:`tsckpt.storage.packed`)."""

    name = PACKED

    def array_kvstore(self, location: Location, path: str) -> dict[str, Any]:
        return packed.read_kvstore(dict(location.spec), path)

    def context(self, parent: ts.Context) -> ts.Context:
        return packed.reader_context(parent)

    def bands(self, location: Location) -> bool:
        # Bands turn a column-resharded load's ranges into one per data file, which pays where a request
        # costs tens of milliseconds. On a local disk a request costs microseconds, while bands scatter a
        # same-topology load's reads and multiply the values written: measured slower there for every load.
        return location.is_object_store

    def rank_prefixes(self, paths: list[str], save_id: str) -> tuple[str, ...]:
        return (f"d/{save_id}",)

    def prefixes_before_planning(self, save_id: str) -> tuple[str, ...]:
        return self.rank_prefixes([], save_id)

    def write_nodes(self, store: OpenedLocation, save_id: str, docs: Mapping[str, bytes],
                    values: packed.StoredValues | None,
                    fence: Callable[[], None]) -> tuple[Span | None, Callable[[], None] | None]:
        assert values is not None, "a packed checkpoint indexes its values"
        entries = packed_index.merged_entries(docs, values)
        return packed_index.write_index(store.kvstore, save_id, entries, store.url, fence,
                                        local_root=_local_root(store.location), sync=store.sync), None

    def locator(self, store: OpenedLocation, metadata: CheckpointMetadata) -> Locator:
        return PackedLocator(store, metadata)

    def hierarchy(self, store: OpenedLocation) -> ts.KvStore:
        try:
            return ts.KvStore.open(packed.read_kvstore(dict(store.location.spec), ""), context=store.context).result()
        except ValueError as e:
            raise storage_error(e, f"cannot open the packed database of {store.url}") from None


LAYOUTS: dict[str, KvLayout] = {layout.name: layout for layout in (PlainLayout(), PackedLayout())}

