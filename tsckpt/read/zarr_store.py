"""A read-only zarr-python ``Store`` over a tsckpt checkpoint, served by TensorStore's kvstore.

``zarr.open_group(tsckpt.zarr_store(path))`` reads any committed checkpoint, plain or packed, without fsspec.
In a packed checkpoint every key but the root ``zarr.json`` lives in the OCDBT database: the store routes each
key, so zarr sees one Zarr v3 hierarchy. What it reads is checked here, so damage names tensor, chunk and file."""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import AsyncIterator, Iterable
from typing import Any

import numpy as np
import tensorstore as ts
from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, Store, SuffixByteRequest
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype

from ..commit import protocol as commit
from ..commit.states import ROOT
from ..errors import ChecksumError, StorageError, TsckptError
from ..format import checksums, compressed, dtypes, shards
from ..format.metadata import ArrayOptions, CheckpointMetadata, TensorEntry
from ..storage import kvio, packed
from ..storage.chunk_source import ChunkSource
from ..storage.context import DEFAULT_IO_CONCURRENCY, make_context, open_kvstore
from ..storage.kvio import problem
from ..storage.layouts import PACKED, PLAIN, get_layout, layout_for
from ..storage.location import Location, LocationLike, parse_location
from ..storage.store import Store as SpecStore


def zarr_store(location: LocationLike, *, allow_incomplete: bool = False,
               io_concurrency: int = DEFAULT_IO_CONCURRENCY) -> TensorStoreZarrStore:
    """A zarr-python ``Store`` reading the checkpoint at ``location``.

    Args:
        location: a path, URL (``s3://bucket/prefix``...) or kvstore spec, as for :func:`tsckpt.save`.
        allow_incomplete: also open a location whose save never committed (to inspect what a dead save
            left); otherwise it raises :class:`~tsckpt.errors.IncompleteCheckpointError`, and an empty one
            :class:`~tsckpt.errors.CheckpointNotFoundError`.
        io_concurrency: concurrent TensorStore requests.

    Returns:
        A store for ``zarr.open_group(store)``, ``zarr.open_array(store, path=...)``,
        ``dask.array.from_zarr(store, component=...)`` or ``xarray.open_zarr(store)``; it refuses every write.
    """
    loc = parse_location(location)
    kv = open_kvstore(loc, make_context(io_concurrency, loc))
    if not allow_incomplete:
        # The committed metadata, or the error that says why there is none; it names the layout.
        metadata = commit.read_metadata(kv, loc.url)
        return TensorStoreZarrStore(loc, layout=layout_for(metadata).name, io_concurrency=io_concurrency,
                                    metadata=metadata)
    return TensorStoreZarrStore(loc, layout=PACKED if packed.is_packed(kv) else PLAIN, io_concurrency=io_concurrency)


class TensorStoreZarrStore(Store):
    """zarr-python's view of one checkpoint location; see :func:`zarr_store`. ``read_only`` is False by default
    only so that ``zarr.open_group(store)`` (default mode ``"a"``) works: every write and delete is refused."""

    supports_writes = supports_deletes = False
    supports_listing = True

    def __init__(self, location: Location, *, layout: str = PLAIN, read_only: bool = False,
                 io_concurrency: int = DEFAULT_IO_CONCURRENCY, metadata: CheckpointMetadata | None = None):
        super().__init__(read_only=read_only)
        get_layout(layout)  # refuses an unknown one
        self.location, self.layout, self.io_concurrency = location, layout, io_concurrency
        #: The committed checkpoint's metadata (None: a location opened as found, committed or not).
        self.metadata = metadata
        self._stores: tuple[ts.KvStore, ts.KvStore] | None = None
        self._source: ChunkSource | None = None
        self._arrays: dict[str, tuple[str, TensorEntry | None]] | None = None
        #: (start, end) of each inner chunk of a compressed chunk, from the shard index zarr read before them.
        self._pieces: dict[str, set[tuple[int, int]]] = {}
        self._opened_at = 0.0
        self._copies: list[weakref.ref[TensorStoreZarrStore]] = []  # what close() closes too

    def _kvstores(self) -> tuple[ts.KvStore, ts.KvStore]:
        """(the plain kvstore at the root, the kvstore holding every other key)."""
        if self._stores is None:
            store = SpecStore.open(self.location, io_concurrency=self.io_concurrency, layout=self.layout)
            if self.metadata is not None:
                store = store.for_checkpoint(self.metadata)
                self._source = ChunkSource.of(store, self.metadata)
            self._stores = (store.kvstore, store.layout.hierarchy(store))
            self._opened_at = time.time()
        return self._stores

    def __getstate__(self) -> dict[str, Any]:
        # TensorStore handles do not pickle (dask may pickle the store); reopen lazily.
        return {**self.__dict__, "_stores": None, "_source": None, "_copies": [], "_pieces": {}}

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
        """Release the TensorStore objects (context, kvstores, node cache); a later read opens them again. The
        read-only copies zarr reads through (``zarr.open_array(store, mode="r")``) are closed with it."""
        self._copies = [ref for ref in self._copies if ref() is not None]
        for copy in [c for ref in self._copies if (c := ref()) is not None]:
            copy.close()
        self._stores = self._source = None
        super().close()

    def with_read_only(self, read_only: bool = False) -> TensorStoreZarrStore:
        copy = type(self)(self.location, layout=self.layout, read_only=read_only,
                          io_concurrency=self.io_concurrency, metadata=self.metadata)
        self._copies.append(weakref.ref(copy))
        return copy

    def _read(self, key: str, byte_range: ByteRequest | None) -> ts.Future:
        plain, keys = self._kvstores()
        # A committed checkpoint never changes: TensorStore need not revalidate cached index nodes on every read.
        kv = plain if key == ROOT else keys
        return kv.read(key, byte_range=as_slice(byte_range), staleness_bound=self._opened_at)

    def _only_out_of_range(self, key: str, error: ValueError) -> None:
        """Let a range past the end through (zarr returns what exists; TensorStore refuses); raise the rest."""
        if "OUT_OF_RANGE" not in str(error):
            raise self._error(key, error) from None

    async def get(self, key: str, prototype: BufferPrototype | None = None,
                  byte_range: ByteRequest | None = None) -> Buffer | None:
        try:
            return self._checked(key, prototype, await self._read(key, byte_range), byte_range)
        except ValueError as e:
            self._only_out_of_range(key, e)
        try:
            whole = await self._read(key, None)
        except ValueError as e:  # the value itself cannot be read: a data file cut short, say
            raise self._error(key, e) from None
        return self._checked(key, prototype, whole, byte_range, clip=True)

    def get_sync(self, key: str, *, prototype: BufferPrototype | None = None,
                 byte_range: ByteRequest | None = None) -> Buffer | None:
        """Synchronous read (zarr's ``SupportsGetSync`` protocol)."""
        try:
            return self._checked(key, prototype, self._read(key, byte_range).result(), byte_range)
        except ValueError as e:
            self._only_out_of_range(key, e)
        try:
            whole = self._read(key, None).result()
        except ValueError as e:
            raise self._error(key, e) from None
        return self._checked(key, prototype, whole, byte_range, clip=True)

    def _checked(self, key: str, prototype: BufferPrototype | None, result: ts.KvStore.ReadResult,
                 byte_range: ByteRequest | None, clip: bool = False) -> Buffer | None:
        """The value read (None for a missing key; ``clip``: a whole value, cut to ``byte_range``), its crc32c
        checked here where it covers whole pieces, so that damage names tensor, chunk and file (zarr's names none)."""
        if result.state != "value":
            return None
        found = self._array_of(key) if self.metadata is not None and self.metadata.codec_checksums else None
        if found is not None:
            problem_text = check_read(key, result.value, None if clip else byte_range, found[1], found[2],
                                      self.metadata.array_options, self._pieces)  # type: ignore[union-attr]
            if problem_text is not None:
                raise self._damage(key, ChecksumError, problem_text)
        value = result.value[as_slice(byte_range)] if clip and byte_range is not None else result.value
        return (prototype or default_buffer_prototype()).buffer.from_bytes(value)

    def _array_of(self, key: str) -> tuple[str, TensorEntry | None, tuple[int, ...]] | None:
        """(the tensor or value's flat key, its entry (None for a value), the chunk's grid index) of a chunk key."""
        if self.metadata is None:
            return None
        if self._arrays is None:
            self._arrays = {e.path: (k, e) for k, e in self.metadata.tensors.items()}
            self._arrays |= {o.path: (k, None) for k, o in self.metadata.objects.items() if o.path is not None}
        path, _, name = key.rpartition("/")
        found = self._arrays.get(path)
        if found is None or not (name == "c" or name.startswith("c.") and name[2:].replace(".", "").isdigit()):
            return None
        return (*found, tuple(int(p) for p in name[2:].split(".")) if name != "c" else ())

    def _stored_at(self, key: str) -> str:
        """Where ``key``'s value is, as the error names it: its file (and range), or why that cannot be said."""
        if self.layout != PACKED or self._source is None:
            return key
        try:
            found = self._source.locator.locate(key)
        except TsckptError:
            found = None
        if found is not None and found.length is not None:
            return f"{found.file} (bytes [{found.offset}, {found.offset + found.length}))"
        # Its writer's chunk table, which ends its data file, cannot say: that data file.
        found_array = self._array_of(key)
        record = (self.metadata.writer_files(found_array[0], found_array[2])
                  if found_array is not None and self.metadata is not None else None)
        if record is None or not record.files:
            return "the packed index"
        return " or ".join(f.path for f in record.files)

    def _damage(self, key: str, kind: type[TsckptError], problem_text: str) -> TsckptError:
        found = self._array_of(key)
        assert found is not None
        what = "tensor" if found[1] is not None else "value"
        return kind(f"{what} {found[0]!r} in {self.location.url}: chunk {key} in {self._stored_at(key)}: "
                    f"{problem_text}")

    async def get_partial_values(self, prototype: BufferPrototype,
                                 key_ranges: Iterable[tuple[str, ByteRequest | None]]) -> list[Buffer | None]:
        return list(await asyncio.gather(*(self.get(key, prototype, r) for key, r in key_ranges)))

    async def exists(self, key: str) -> bool:
        try:
            result = await self._read(key, RangeByteRequest(0, 0))
        except ValueError as e:
            raise self._error(key, e) from None
        return result.state == "value"

    def list(self) -> AsyncIterator[str]:
        return self.list_prefix("")

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

    async def set(self, key: str, value: Buffer) -> None:
        raise self._read_only_error(key)

    set_if_not_exists = set

    async def delete(self, key: str) -> None:
        raise self._read_only_error(key)

    def _read_only_error(self, key: str) -> ValueError:
        return ValueError(f"{self.location.url} is a tsckpt checkpoint, read-only through zarr_store: "
                          f"cannot change {key!r}")

    def _error(self, key: str, e: Exception) -> TsckptError:
        if self._array_of(key) is not None:
            kind = ChecksumError if "DATA_LOSS" in str(e) else StorageError
            past = "it lies past the end of the file, which was cut short: " if "OUT_OF_RANGE" in str(e) else ""
            return self._damage(key, kind, f"{past}reading it failed: {problem(e)}")
        return StorageError(f"reading {key!r} from {self.location.url} failed: {problem(e)}")


# The crc32c checks of what zarr-python reads of a chunk: a whole chunk as stored (compressed: decoded), of a
# part what covers whole checksummed pieces (the shard index, an inner chunk). Damage is returned as a problem.

_CHANGED = "does not match its stored crc32c (the data changed after it was written)"


def check_read(key: str, value: bytes, byte_range: ByteRequest | None, entry: TensorEntry | None,
               index: tuple[int, ...], options: ArrayOptions, pieces: dict[str, set[tuple[int, int]]]) -> str | None:
    """What is wrong with ``value``, read by ``byte_range`` from chunk ``index`` (key ``key``) of tensor ``entry``
    (None: a value blob), if anything. ``pieces`` keeps, per key, the inner chunks a compressed chunk's index
    gave, for the reads of them that follow."""
    if entry is None:  # a value blob: one piece, read whole
        return f"its blob {_CHANGED}" if byte_range is None and not checksums.intact(value) else None
    fmt = shards.value_format(entry, options)
    data = np.frombuffer(value, dtype=np.uint8)
    if options.compression is not None:
        return _check_compressed(key, entry, options, fmt, data, byte_range, pieces)
    start, end, _ = (as_slice(byte_range) or slice(None)).indices(fmt.nbytes)
    if (start, end) == (0, fmt.nbytes):
        try:
            shards.check_stored_codec(fmt, index, data, "")
        except ChecksumError as e:
            return str(e).removeprefix(": ")
    elif fmt.indexed and (start, end) == (fmt.nbytes - fmt.index_bytes, fmt.nbytes):
        if not checksums.intact(data):
            return "its shard index does not match its stored crc32c"
    elif end <= fmt.pieces * fmt.piece_bytes and start % fmt.piece_bytes == 0 and data.size % fmt.piece_bytes == 0:
        for at in range(0, data.size, fmt.piece_bytes):
            if not checksums.intact(data[at:at + fmt.piece_bytes]):
                return f"the inner chunk at bytes [{start + at}, {start + at + fmt.piece_bytes}) {_CHANGED}"
    return None


def _check_compressed(key: str, entry: TensorEntry, options: ArrayOptions, fmt: shards.ShardFormat,
                      data: np.ndarray, byte_range: ByteRequest | None,
                      pieces: dict[str, set[tuple[int, int]]]) -> str | None:
    """Compressed chunks: a whole one decoded and checked; its index, and then each inner chunk zarr reads by
    the ranges the index gives, by the crc32c each ends with."""
    assert options.compression is not None
    if byte_range is None:
        try:
            compressed.decode(fmt, options.compression, data, dtypes.from_zarr(entry.dtype).numpy, "")
        except ChecksumError as e:
            return str(e).removeprefix(": ")
        return None
    if fmt.indexed and isinstance(byte_range, SuffixByteRequest) and byte_range.suffix == fmt.index_bytes:
        if not checksums.intact(data):
            return "its shard index does not match its stored crc32c"
        pairs = np.frombuffer(data[:16 * fmt.pieces].tobytes(), dtype="<u8").reshape(-1, 2)
        pieces[key] = {(int(o), int(o + n)) for o, n in pairs.tolist() if o != shards.MISSING}
    elif isinstance(byte_range, RangeByteRequest) and (byte_range.start, byte_range.end) in pieces.get(key, ()):
        if not checksums.intact(data):
            return f"the inner chunk at bytes [{byte_range.start}, {byte_range.end}) {_CHANGED}"
    return None


def as_slice(byte_range: ByteRequest | None) -> slice | None:
    """zarr-python's byte request as the slice TensorStore reads (None: the whole value)."""
    if byte_range is None:
        return None
    if isinstance(byte_range, RangeByteRequest):
        return slice(byte_range.start, byte_range.end)
    if isinstance(byte_range, OffsetByteRequest):
        return slice(byte_range.offset, None)
    if isinstance(byte_range, SuffixByteRequest):
        return slice(-byte_range.suffix, None) if byte_range.suffix else slice(0, 0)
    raise TypeError(f"unexpected byte range {byte_range!r}")
