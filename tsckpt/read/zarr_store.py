"""A read-only zarr-python ``Store`` over a tsckpt checkpoint, served by TensorStore's kvstore.

``zarr.open_group(tsckpt.zarr_store(path))`` reads any committed checkpoint,
plain or packed, local or on an object store: TensorStore does the I/O, so
every location tsckpt writes to (``s3://``, ``gs://``, ``memory://``, a kvstore
spec) is readable by zarr-python, dask and xarray without fsspec.

In a packed checkpoint every key but the root ``zarr.json`` lives in the
OCDBT database (:mod:`tsckpt.storage.packed`); the root document is a plain
file beside it. The store routes each key accordingly, so zarr-python sees one
ordinary Zarr v3 hierarchy either way. Chunks carry Zarr's crc32c codec
(unless saved with ``checksums=False``), which zarr-python checks itself.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import AsyncIterator, Iterable
from typing import Any

import tensorstore as ts
from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, Store, SuffixByteRequest
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype

from ..errors import StorageError, TsckptError
from ..commit import protocol as commit
from ..storage import kvio, packed
from ..storage.layouts import PACKED, PLAIN, get_layout, layout_for
from ..storage.store import Store as SpecStore
from ..commit.states import ROOT
from ..format.metadata import CheckpointMetadata
from ..storage.context import DEFAULT_IO_CONCURRENCY, make_context, open_kvstore
from ..storage.location import Location, LocationLike, parse_location
from ..storage.kvio import problem


def zarr_store(location: LocationLike, *, allow_incomplete: bool = False,
               io_concurrency: int = DEFAULT_IO_CONCURRENCY) -> TensorStoreZarrStore:
    """A zarr-python ``Store`` reading the checkpoint at ``location``.

    Args:
        location: a path, URL (``s3://bucket/prefix``...) or kvstore spec, as
            for :func:`tsckpt.save`.
        allow_incomplete: also open a location whose save never committed
            (for inspecting what a dead save left). Otherwise such a location
            raises :class:`~tsckpt.errors.IncompleteCheckpointError`, and an
            empty one :class:`~tsckpt.errors.CheckpointNotFoundError`.
        io_concurrency: concurrent TensorStore requests.

    Returns:
        A store for ``zarr.open_group(store)``, ``zarr.open_array(store,
        path=...)``, ``dask.array.from_zarr(store, component=...)`` or
        ``xarray.open_zarr(store)``. It refuses every write.
    """
    loc = parse_location(location)
    kv = open_kvstore(loc, make_context(io_concurrency, loc))
    if not allow_incomplete:
        # The committed metadata, or the error that says why there is none; it names the layout.
        metadata = commit.read_metadata(kv, loc.url)
        return TensorStoreZarrStore(loc, layout=layout_for(metadata).name, io_concurrency=io_concurrency,
                                    metadata=metadata)
    layout = PACKED if packed.is_packed(kv) else PLAIN
    return TensorStoreZarrStore(loc, layout=layout, io_concurrency=io_concurrency)


class TensorStoreZarrStore(Store):
    """zarr-python's view of one checkpoint location; see :func:`zarr_store`.

    ``read_only`` is False by default only so that ``zarr.open_group(store)``
    (whose default mode ``"a"`` rejects read-only stores) works; the store
    itself refuses every write and delete whatever the flag says.
    """

    supports_writes = False
    supports_deletes = False
    supports_listing = True

    def __init__(self, location: Location, *, layout: str = PLAIN, read_only: bool = False,
                 io_concurrency: int = DEFAULT_IO_CONCURRENCY, metadata: CheckpointMetadata | None = None):
        super().__init__(read_only=read_only)
        get_layout(layout)  # refuses an unknown one
        self.location = location
        self.layout = layout
        self.io_concurrency = io_concurrency
        #: The committed checkpoint's metadata (None: a location opened as found, committed or not).
        self.metadata = metadata
        self._stores: tuple[ts.KvStore, ts.KvStore] | None = None
        self._opened_at = 0.0
        self._copies: list[weakref.ref[TensorStoreZarrStore]] = []  # what close() closes too

    # --- plumbing ----------------------------------------------------------

    def _kvstores(self) -> tuple[ts.KvStore, ts.KvStore]:
        """(the plain kvstore at the root, the kvstore holding every other key)."""
        if self._stores is None:
            store = SpecStore.open(self.location, io_concurrency=self.io_concurrency, layout=self.layout)
            if self.metadata is not None:
                store = store.for_checkpoint(self.metadata)
            self._stores = (store.kvstore, store.layout.hierarchy(store))
            self._opened_at = time.time()
        return self._stores

    def _route(self, key: str) -> ts.KvStore:
        plain, keys = self._kvstores()
        return plain if key == ROOT else keys

    def __getstate__(self) -> dict[str, Any]:
        # TensorStore handles do not pickle (dask may pickle the store); reopen lazily.
        return {**self.__dict__, "_stores": None, "_copies": []}

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, TensorStoreZarrStore) and self.location == other.location
                and self.layout == other.layout and self.read_only == other.read_only)

    def __hash__(self) -> int:
        return hash((self.location.url, self.layout, self.read_only))

    def __str__(self) -> str:
        return self.location.url

    def __repr__(self) -> str:
        return f"TensorStoreZarrStore({self.location.url!r}, layout={self.layout!r})"

    def close(self) -> None:
        """Release the TensorStore objects (context, kvstores, node cache); a later read opens them again.

        The read-only copies zarr reads through (``zarr.open_array(store,
        mode="r")`` makes one) are closed with it. ``with store:`` calls it.
        """
        self._copies = [ref for ref in self._copies if ref() is not None]
        for ref in self._copies:
            copy = ref()
            if copy is not None:
                copy.close()
        self._stores = None
        super().close()

    def with_read_only(self, read_only: bool = False) -> TensorStoreZarrStore:
        copy = type(self)(self.location, layout=self.layout, read_only=read_only,
                          io_concurrency=self.io_concurrency, metadata=self.metadata)
        self._copies.append(weakref.ref(copy))
        return copy

    # --- reads -------------------------------------------------------------

    def _read(self, key: str, byte_range: ByteRequest | None) -> ts.Future:
        # A committed checkpoint never changes: what was current when the store
        # opened is current, so TensorStore need not revalidate its cached
        # manifest and B+tree nodes on every read.
        kv = self._route(key)
        return kv.read(key, byte_range=_as_slice(byte_range), staleness_bound=self._opened_at)

    def _only_out_of_range(self, key: str, error: ValueError) -> None:
        """Let a range past the end through (zarr returns what exists; TensorStore refuses); raise the rest."""
        if "OUT_OF_RANGE" not in str(error):
            raise self._error(key, error) from None

    async def get(self, key: str, prototype: BufferPrototype | None = None,
                  byte_range: ByteRequest | None = None) -> Buffer | None:
        try:
            return self._buffer(prototype, await self._read(key, byte_range))
        except ValueError as e:
            self._only_out_of_range(key, e)
        return self._buffer(prototype, await self._read(key, None), byte_range)

    def get_sync(self, key: str, *, prototype: BufferPrototype | None = None,
                 byte_range: ByteRequest | None = None) -> Buffer | None:
        """Synchronous read (zarr's ``SupportsGetSync`` protocol)."""
        try:
            return self._buffer(prototype, self._read(key, byte_range).result())
        except ValueError as e:
            self._only_out_of_range(key, e)
        return self._buffer(prototype, self._read(key, None).result(), byte_range)

    async def get_partial_values(self, prototype: BufferPrototype,
                                 key_ranges: Iterable[tuple[str, ByteRequest | None]]) -> list[Buffer | None]:
        return list(await asyncio.gather(*(self.get(key, prototype, r) for key, r in key_ranges)))

    async def exists(self, key: str) -> bool:
        try:
            result = await self._read(key, RangeByteRequest(0, 0))
        except ValueError as e:
            raise self._error(key, e) from None
        return result.state == "value"

    async def getsize(self, key: str) -> int:
        value = await self.get(key)
        if value is None:
            raise FileNotFoundError(key)
        return len(value)

    # --- listing -----------------------------------------------------------

    async def list(self) -> AsyncIterator[str]:
        for key in await self._list(""):
            yield key

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        for key in await self._list(prefix):
            yield key

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        prefix = prefix.rstrip("/")
        start = f"{prefix}/" if prefix else ""
        children = {key[len(start):].split("/", 1)[0] for key in await self._list(start)}
        for name in sorted(children - {""}):
            yield name

    async def _list(self, prefix: str) -> list[str]:
        plain, keys = self._kvstores()
        rng = kvio.prefix_range(prefix)
        try:
            found = {k.decode("utf-8", "surrogateescape") for k in await keys.list(rng)}
            if keys is not plain and ROOT.startswith(prefix):
                found.discard(ROOT)  # the root document outside the database is the only one
                if (await self._read(ROOT, RangeByteRequest(0, 0))).state == "value":
                    found.add(ROOT)
        except ValueError as e:
            raise self._error(prefix or "(all keys)", e) from None
        return sorted(found)

    # --- writes: refused ---------------------------------------------------

    async def set(self, key: str, value: Buffer) -> None:
        raise self._read_only_error(key)

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        raise self._read_only_error(key)

    async def delete(self, key: str) -> None:
        raise self._read_only_error(key)

    def _read_only_error(self, key: str) -> ValueError:
        return ValueError(f"{self.location.url} is a tsckpt checkpoint, read-only through zarr_store: "
                          f"cannot change {key!r}")

    def _error(self, key: str, e: Exception) -> TsckptError:
        return StorageError(f"reading {key!r} from {self.location.url} failed: {problem(e)}")

    @staticmethod
    def _buffer(prototype: BufferPrototype | None, result: ts.KvStore.ReadResult,
                clip: ByteRequest | None = None) -> Buffer | None:
        """The value read, or None for a missing key; ``clip`` cuts a whole value to a range."""
        if result.state != "value":
            return None
        value = result.value if clip is None else _clip(result.value, clip)
        return (prototype or default_buffer_prototype()).buffer.from_bytes(value)


def _as_slice(byte_range: ByteRequest | None) -> slice | None:
    if byte_range is None:
        return None
    if isinstance(byte_range, RangeByteRequest):
        return slice(byte_range.start, byte_range.end)
    if isinstance(byte_range, OffsetByteRequest):
        return slice(byte_range.offset, None)
    if isinstance(byte_range, SuffixByteRequest):
        return slice(-byte_range.suffix, None) if byte_range.suffix else slice(0, 0)
    raise TypeError(f"unexpected byte range {byte_range!r}")


def _clip(value: bytes, byte_range: ByteRequest | None) -> bytes:
    """What zarr's own stores return for a range that runs past the end of ``value``."""
    if isinstance(byte_range, RangeByteRequest):
        return value[byte_range.start:byte_range.end]
    if isinstance(byte_range, OffsetByteRequest):
        return value[byte_range.offset:]
    if isinstance(byte_range, SuffixByteRequest):
        return value[max(len(value) - byte_range.suffix, 0):]
    return value
