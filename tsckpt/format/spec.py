"""The one place that builds TensorStore specs for a checkpoint's arrays, and picks their kvstore.

Every array tsckpt writes or reads (tensors and value blobs, from the DCP writer
and reader, :func:`tsckpt.open`, verification, the builder and the conversion
source) is opened through :class:`Store`, so all of them share the same options:

* ``store_data_equal_to_fill_value``: every chunk is stored, even all-zero ones,
  so a missing chunk file always means damage;
* ``fill_missing_data_reads: false``: a missing chunk is an error naming the
  chunk, never zeros;
* reads state the data type, shape, chunk grid and inner chunks the root
  document expects, so an array that disagrees fails to open;
* one TensorStore context made from the location's own resources.

Where an array's bytes live is a :class:`KvLayout`, registered by name in
:data:`LAYOUTS`. ``"plain"`` keeps each array under its own path below the
location (the Zarr hierarchy as files or objects). Another layout plugs in by
subclassing :class:`KvLayout` and decorating it with :func:`register_layout`;
:func:`layout_for` is where a checkpoint's metadata selects its layout.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import tensorstore as ts

from ..errors import MetadataError, TsckptError
from ..location import (
    DEFAULT_IO_CONCURRENCY,
    Location,
    LocationLike,
    make_context,
    open_kvstore,
    parse_location,
    unsynced_nodes,
)
from ..packed import PackedLayout, reader_context
from . import checksums, zarr_json
from .metadata import ArrayOptions, CheckpointMetadata, TensorEntry

#: Options every tsckpt array is opened with, for writing and for reading.
ALWAYS: Mapping[str, Any] = {"store_data_equal_to_fill_value": True, "fill_missing_data_reads": False}
PLAIN = "plain"
PACKED = PackedLayout.name


class KvLayout(ABC):
    """How a checkpoint's arrays and node documents map onto kvstores under its location."""

    name: ClassVar[str]

    @abstractmethod
    def array_kvstore(self, location: Location, path: str) -> dict[str, Any]:
        """The kvstore spec that holds the array at ``path`` (its ``zarr.json`` and chunks) for readers."""

    def write_kvstore(self, location: Location, rank: int, path: str) -> dict[str, Any]:
        """The kvstore spec rank ``rank`` writes the chunks of the array at ``path`` into."""
        return self.array_kvstore(location, path)

    def context(self, parent: ts.Context) -> ts.Context:
        """The context every array of a location is opened with (a layout may add resources)."""
        return parent

    def rank_transaction(self) -> ts.Transaction | None:
        """A transaction all of one rank's writes go through, committed after the last (None: none)."""
        return None

    def prepare(self, store: Store) -> None:
        """Coordinator, before any rank writes to an uncommitted location: clear what a dead save left."""

    def nodes(self, store: Store, world_size: int) -> tuple[ts.KvStore, Callable[[], None] | None]:
        """Where the commit writes ``<path>/zarr.json`` documents, and a call that makes them durable.

        ``world_size`` ranks wrote the arrays. The flush (if any) runs before
        the root document is written.
        """
        return store.kvstore, None


LAYOUTS: dict[str, KvLayout] = {}


def register_layout(cls: type[KvLayout]) -> type[KvLayout]:
    """Class decorator: make a layout available by its ``name``."""
    LAYOUTS[cls.name] = cls()
    return cls


def get_layout(name: str) -> KvLayout:
    try:
        return LAYOUTS[name]
    except KeyError:
        raise TsckptError(f"unknown storage layout {name!r}; expected one of {sorted(LAYOUTS)}") from None


def layout_for(metadata: CheckpointMetadata) -> KvLayout:
    """The layout a committed checkpoint was written with (every version-1 checkpoint is plain)."""
    try:
        return LAYOUTS[metadata.layout]
    except KeyError:
        raise MetadataError(f"checkpoint metadata: unknown storage layout {metadata.layout!r}; "
                            f"expected one of {sorted(LAYOUTS)}") from None


@register_layout
class PlainLayout(KvLayout):
    """Each array under its own path below the location: the Zarr hierarchy as files or objects."""

    name = PLAIN

    def array_kvstore(self, location: Location, path: str) -> dict[str, Any]:
        return location.child(path)

    def nodes(self, store: Store, world_size: int) -> tuple[ts.KvStore, Callable[[], None] | None]:
        # On local Linux paths, skip a per-file fsync and flush the filesystem once instead.
        fast = unsynced_nodes(store.location)
        return fast if fast is not None else (store.kvstore, None)


@register_layout
class PackedKvLayout(KvLayout):
    """Every chunk in a few large files: per-rank OCDBT databases joined at commit (:mod:`tsckpt.packed`)."""

    name = PACKED

    def __init__(self, packed: PackedLayout = PackedLayout()) -> None:
        self.packed = packed

    def array_kvstore(self, location: Location, path: str) -> dict[str, Any]:
        return self.packed.read_kvstore(dict(location.spec), path)

    def write_kvstore(self, location: Location, rank: int, path: str) -> dict[str, Any]:
        return self.packed.write_kvstore(dict(location.spec), rank, path)

    def context(self, parent: ts.Context) -> ts.Context:
        return reader_context(parent)

    def rank_transaction(self) -> ts.Transaction | None:
        # One OCDBT commit per rank: data files of the target size, not one per flush.
        return self.packed.rank_transaction()

    def prepare(self, store: Store) -> None:
        self.packed.prepare(store.kvstore)

    def nodes(self, store: Store, world_size: int) -> tuple[ts.KvStore, Callable[[], None] | None]:
        return self.packed.join(dict(store.location.spec), world_size, store.context)


# --- specs --------------------------------------------------------------------


def write_spec(kvstore: Mapping[str, Any], zarr_metadata: Mapping[str, Any]) -> dict[str, Any]:
    """An array opened from the metadata given, without reading its ``zarr.json``.

    Writers use it before any ``zarr.json`` exists (the commit writes them);
    readers of a version-2 checkpoint use it with the metadata the root document implies.
    """
    return {"driver": "zarr3", "kvstore": dict(kvstore), "metadata": dict(zarr_metadata),
            "assume_metadata": True, **ALWAYS}


def read_spec(
    kvstore: Mapping[str, Any],
    *,
    dtype: str | None = None,
    shape: Sequence[int] | None = None,
    chunk_shape: Sequence[int] | None = None,
    inner_chunk_shape: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Read an existing array; what is given must match its ``zarr.json`` or the open fails."""
    expect: dict[str, Any] = {}
    if dtype is not None:
        expect["data_type"] = dtype
    if shape is not None:
        expect["shape"] = list(shape)
    if chunk_shape is not None:
        expect["chunk_grid"] = {"name": "regular", "configuration": {"chunk_shape": list(chunk_shape)}}
    if inner_chunk_shape is not None:
        expect["codecs"] = [{"name": "sharding_indexed", "configuration": {"chunk_shape": list(inner_chunk_shape)}}]
    spec: dict[str, Any] = {"driver": "zarr3", "kvstore": dict(kvstore), **ALWAYS}
    if expect:
        spec["metadata"] = expect
    return spec


def tensor_read_spec(kvstore: Mapping[str, Any], entry: TensorEntry) -> dict[str, Any]:
    """Read a tensor's array as the root document describes it."""
    return read_spec(kvstore, dtype=entry.dtype, shape=entry.shape, chunk_shape=entry.chunk_shape,
                     inner_chunk_shape=entry.inner_chunk_shape)


def blob_read_spec(kvstore: Mapping[str, Any]) -> dict[str, Any]:
    """Read a value blob: a 1-d ``uint8`` array."""
    spec = read_spec(kvstore, dtype="uint8")
    spec["rank"] = 1
    return spec


# --- an opened location -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Store:
    """A checkpoint location opened in this process: one context, its root kvstore, its layout.

    Make one with :meth:`open`; after reading the metadata, :meth:`for_checkpoint`
    switches to the layout the checkpoint was written with.
    """

    location: Location
    context: ts.Context
    kvstore: ts.KvStore
    layout: KvLayout = dataclasses.field(default_factory=lambda: get_layout(PLAIN))
    #: The checkpoint's codecs, once its metadata is known (None: read each array's zarr.json).
    array_options: ArrayOptions | None = None

    @classmethod
    def open(cls, location: LocationLike, *, io_concurrency: int = DEFAULT_IO_CONCURRENCY,
             layout: str = PLAIN) -> Store:
        loc = parse_location(location)
        kv_layout = get_layout(layout)
        context = kv_layout.context(make_context(io_concurrency, loc))
        return cls(loc, context, open_kvstore(loc, context), kv_layout)

    @property
    def url(self) -> str:
        return self.location.url

    def for_checkpoint(self, metadata: CheckpointMetadata) -> Store:
        layout = layout_for(metadata)
        context = self.context if layout is self.layout else layout.context(self.context)
        return dataclasses.replace(self, layout=layout, context=context, array_options=metadata.array_options)

    def array_kvstore(self, path: str) -> dict[str, Any]:
        return self.layout.array_kvstore(self.location, path)

    def create(self, path: str, zarr_metadata: Mapping[str, Any], rank: int = 0) -> ts.Future:
        """Open the array at ``path`` for rank ``rank`` to write chunks, before its ``zarr.json`` exists."""
        kvstore = self.layout.write_kvstore(self.location, rank, path)
        return ts.open(write_spec(kvstore, zarr_metadata), context=self.context)

    def open_tensor(self, entry: TensorEntry) -> ts.Future:
        """Open a tensor's array for reading as the root document describes it.

        When the document records the codecs (format version 2) the array's
        ``zarr.json`` is not read at all: no request per array per rank, and a
        crafted ``zarr.json`` cannot change how chunks are decoded.
        """
        kvstore = self.array_kvstore(entry.path)
        if self.array_options is not None:
            spec = write_spec(kvstore, zarr_json.tensor_metadata(entry, self.array_options))
            return ts.open(spec, context=self.context, read=True)
        return ts.open(tensor_read_spec(kvstore, entry), context=self.context, open=True, read=True)

    def open_blob(self, path: str) -> ts.Future:
        """Open a value blob for reading."""
        return ts.open(blob_read_spec(self.array_kvstore(path)), context=self.context, open=True, read=True)

    def read_blob(self, key: str, path: str) -> bytes:
        """The bytes of a value blob, or a clear error naming the value."""
        try:
            return self.open_blob(path).result().read().result().tobytes()
        except ValueError as e:
            raise TsckptError(f"reading value {key!r} from {self.url}/{path} failed: {e}") from None

    def read_tensor(self, key: str, entry: TensorEntry) -> Any:
        """The whole tensor as numpy, or a clear error naming the tensor (and the chunk, when one is missing)."""
        try:
            data = self.open_tensor(entry).result().read().result()
        except ValueError as e:
            raise read_error(key, self.url, e) from None
        checksums.check_read(entry, data, (0,) * len(entry.shape), f"tensor {key!r} in {self.url}")
        return data


def read_error(key: str, url: str, e: Exception) -> TsckptError:
    """The error for a tensor whose array could not be opened or read (TensorStore's text names the chunk)."""
    return TsckptError(f"reading tensor {key!r} from {url} failed: {e}")
