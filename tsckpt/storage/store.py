"""The one place that builds TensorStore specs for a checkpoint's arrays, and picks their kvstore.

Every array tsckpt writes or reads (tensors and value blobs, from the DCP writer
and reader, :func:`tsckpt.open`, verification, the builder and the conversion
source) is opened through :class:`Store`, so all of them share the same options:

* ``store_data_equal_to_fill_value``: every chunk is stored, even all-zero ones,
  so a missing chunk file always means damage;
* ``fill_missing_data_reads: false``: a missing chunk is an error naming the
  chunk, never zeros;
* reads state the data type, shape, chunk grid, inner chunks and codecs the
  root document expects, so an array whose ``zarr.json`` disagrees (a crafted
  one declaring huge chunks or a decompression bomb) fails to open before any
  chunk is read;
* one TensorStore context made from the location's own resources.

Where an array's keys live is the store's :class:`~tsckpt.storage.layouts.KvLayout`
(one file per chunk, or a packed OCDBT database): the layout gives the kvstore
spec, this module everything around it. tsckpt itself writes chunks through
its own sinks (:mod:`tsckpt.storage.sinks`) and reads those of version-3 and
later checkpoints by byte range (:mod:`tsckpt.storage.box_reader`); the array
specs here open what TensorStore reads for it: older checkpoints' arrays and
value blobs.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import tensorstore as ts

from ..errors import StorageError, TsckptError
from .context import DEFAULT_IO_CONCURRENCY, make_context, open_kvstore
from .location import Location, LocationLike, parse_location
from ..format import zarr_json
from .layouts import PACKED, KvLayout, get_layout, layout_for
from .kvio import problem, storage_error
from ..format.metadata import ArrayOptions, CheckpointMetadata, TensorEntry

#: Options every tsckpt array is opened with, for writing and for reading.
ALWAYS: Mapping[str, Any] = {"store_data_equal_to_fill_value": True, "fill_missing_data_reads": False}


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
    codecs: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """Read an existing array; what is given must match its ``zarr.json`` exactly or the open fails."""
    expect: dict[str, Any] = {}
    if dtype is not None:
        expect["data_type"] = dtype
    if shape is not None:
        expect["shape"] = list(shape)
    if chunk_shape is not None:
        expect["chunk_grid"] = {"name": "regular", "configuration": {"chunk_shape": list(chunk_shape)}}
    if codecs is not None:
        expect["codecs"] = [dict(c) for c in codecs]
    elif inner_chunk_shape is not None:
        expect["codecs"] = [{"name": "sharding_indexed", "configuration": {"chunk_shape": list(inner_chunk_shape)}}]
    spec: dict[str, Any] = {"driver": "zarr3", "kvstore": dict(kvstore), **ALWAYS}
    if expect:
        spec["metadata"] = expect
    return spec


def tensor_read_spec(kvstore: Mapping[str, Any], entry: TensorEntry,
                     codecs: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """Read a tensor's array as the root document describes it (with ``codecs``, exactly those)."""
    return read_spec(kvstore, dtype=entry.dtype, shape=entry.shape, chunk_shape=entry.chunk_shape,
                     inner_chunk_shape=entry.inner_chunk_shape, codecs=codecs)


def blob_read_spec(kvstore: Mapping[str, Any]) -> dict[str, Any]:
    """Read a value blob: a 1-d ``uint8`` array with the blob codecs (uncompressed, crc32c)."""
    spec = read_spec(kvstore, dtype="uint8", codecs=zarr_json.BLOB_CODECS)
    spec["rank"] = 1
    return spec


@functools.lru_cache(maxsize=256)
def _normalized_chains(dtype: str, inner: tuple[int, ...] | None) -> tuple[str, ...]:
    """Every codec chain tsckpt writes for such an array, as TensorStore prints it."""
    return tuple(json.dumps(ts.CodecSpec({"driver": "zarr3", "codecs": chain}).to_json(), sort_keys=True)
                 for chain in zarr_json.possible_codecs(dtype, inner))


def check_codecs(array: ts.TensorStore, entry: TensorEntry) -> ts.TensorStore:
    """``array`` if its codecs are a chain tsckpt writes for ``entry``, else ``ValueError``.

    For checkpoints whose root document does not say which writer options
    (checksums, compression) were used; otherwise the read spec pins the chain.
    """
    found = json.dumps(array.codec.to_json(), sort_keys=True)
    if found not in _normalized_chains(entry.dtype, entry.inner_chunk_shape):
        raise ValueError(f"its zarr.json declares codecs {array.codec.to_json().get('codecs')!r}, "
                         f"which tsckpt never writes for a {entry.dtype} array")
    return array


def check_blob(array: ts.TensorStore) -> ts.Future:
    """A future of ``array`` once its single chunk is known to hold all the bytes ``zarr.json`` declares.

    Blob codecs are pinned to raw bytes plus a 4-byte crc32c, so the stored
    chunk is exactly ``n + 4`` bytes: probing one byte stops a crafted
    ``zarr.json`` that declares a huge length from making the reader allocate it.
    """
    n = array.shape[0]
    if array.chunk_layout.write_chunk.shape != (max(n, 1),):
        raise ValueError(f"a value blob is one chunk of its whole length {n}, "
                         f"not chunks of {list(array.chunk_layout.write_chunk.shape)}")
    promise, out = ts.Promise.new()
    if n == 0:
        promise.set_result(array)
        return out
    meta = array.spec().to_json().get("metadata", {})
    key = zarr_json.chunk_key((0,), zarr_json.chunk_key_separator(meta))
    last = n + zarr_json.BLOB_CHECKSUM_BYTES - 1

    def probed(f: ts.Future) -> None:
        try:
            f.result()
        except ValueError as e:
            if "OUT_OF_RANGE" not in str(e):
                promise.set_exception(e)
                return
            promise.set_exception(ValueError(f"chunk {key} holds fewer bytes than the {n} its zarr.json declares"))
            return
        promise.set_result(array)  # a missing chunk is reported by the read itself

    array.kvstore.read(key, byte_range=slice(last, last + 1)).add_done_callback(probed)
    return out


def then(first: ts.Future, step: Callable[[Any], Any]) -> ts.Future:
    """A future of ``step(first.result())``; when ``step`` returns a future, of that future's result."""
    promise, out = ts.Promise.new()

    def settle(f: ts.Future, step: Callable[[Any], Any] | None) -> None:
        try:
            value = f.result()
            if step is not None:
                value = step(value)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            promise.set_exception(e)
            return
        if isinstance(value, ts.Future):
            value.add_done_callback(lambda g: settle(g, None))
        else:
            promise.set_result(value)

    first.add_done_callback(lambda f: settle(f, step))
    return out


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
    layout: KvLayout = dataclasses.field(default_factory=lambda: get_layout(PACKED))
    #: The checkpoint's codecs, once its metadata is known (None: read each array's zarr.json).
    array_options: ArrayOptions | None = None
    #: Whether what is written here is made durable before the commit (False: nothing is fsynced,
    #: ``sync_files=False``).
    sync: bool = True

    @classmethod
    def open(cls, location: LocationLike, *, io_concurrency: int = DEFAULT_IO_CONCURRENCY,
             layout: str = PACKED, sync: bool = True) -> Store:
        loc = parse_location(location)
        kv_layout = get_layout(layout)
        context = kv_layout.context(make_context(io_concurrency, loc, sync=sync))
        return cls(loc, context, open_kvstore(loc, context), kv_layout, sync=sync)

    @property
    def url(self) -> str:
        return self.location.url

    def for_checkpoint(self, metadata: CheckpointMetadata) -> Store:
        layout = layout_for(metadata)
        context = self.context if layout is self.layout else layout.context(self.context)
        return dataclasses.replace(self, layout=layout, context=context, array_options=metadata.array_options)

    def array_kvstore(self, path: str) -> dict[str, Any]:
        return self.layout.array_kvstore(self.location, path)

    def open_tensor(self, entry: TensorEntry) -> ts.Future:
        """Open a tensor's array for reading as the root document describes it.

        When the document records the codecs (format version 2 and later) the
        array's ``zarr.json`` is not read at all: no request per array per rank,
        and a crafted ``zarr.json`` cannot change how chunks are decoded.
        Otherwise (version 1) the array's codecs must be one of the chains
        tsckpt writes.
        """
        kvstore = self.array_kvstore(entry.path)
        if self.array_options is not None:
            spec = write_spec(kvstore, zarr_json.tensor_metadata(entry, self.array_options))
            return ts.open(spec, context=self.context, read=True)
        opening = ts.open(tensor_read_spec(kvstore, entry, None), context=self.context, open=True, read=True)
        return then(opening, lambda arr: check_codecs(arr, entry))

    def open_blob(self, path: str) -> ts.Future:
        """Open a value blob for reading, checked to hold as many bytes as it declares."""
        return then(ts.open(blob_read_spec(self.array_kvstore(path)), context=self.context, open=True, read=True),
                    check_blob)

    def node_kvstore(self, path: str) -> ts.KvStore:
        """The kvstore holding the node (array or group) at ``path``: its ``zarr.json`` and chunk keys."""
        try:
            return ts.KvStore.open(self.array_kvstore(path), context=self.context).result()
        except ValueError as e:
            raise storage_error(e, f"cannot open {self.url}/{path}") from None

    def read_blob(self, key: str, path: str) -> bytes:
        """The bytes of a value blob, or a clear error naming the value."""
        try:
            return self.open_blob(path).result().read().result().tobytes()
        except ValueError as e:
            raise storage_error(e, f"reading value {key!r} from {self.url}/{path} failed") from None


def read_error(key: str, url: str, e: Exception) -> TsckptError:
    """The error for a tensor whose array could not be opened or read (TensorStore's text names the chunk)."""
    return StorageError(f"reading tensor {key!r} from {url} failed: {problem(e)}")
