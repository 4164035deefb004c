"""An opened checkpoint location (:class:`Store`), and the TensorStore specs of the arrays it reads.

tsckpt writes and reads chunks itself (:mod:`tsckpt.storage.sinks`, :mod:`tsckpt.storage.box_reader`);
TensorStore opens value blobs for ``verify``, with the options every tsckpt array has (:data:`ALWAYS`: a missing
chunk is an error, never zeros) and the data type and codecs tsckpt writes stated, so an array whose ``zarr.json``
disagrees (a crafted one declaring huge chunks) fails to open before any chunk is read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import tensorstore as ts

from ..errors import StorageError, TsckptError
from ..format import zarr_json
from ..format.metadata import CheckpointMetadata
from .context import DEFAULT_IO_CONCURRENCY, OpenedLocation, make_context, open_kvstore
from .kvio import problem, storage_error
from .layouts import PACKED, KvLayout, get_layout, layout_for
from .location import LocationLike, parse_location

#: Options every tsckpt array is opened with: every chunk is stored, even all-zero ones, so a missing one is damage.
ALWAYS: Mapping[str, Any] = {"store_data_equal_to_fill_value": True, "fill_missing_data_reads": False}


def blob_read_spec(kvstore: Mapping[str, Any]) -> dict[str, Any]:
    """Read a value blob: a 1-d ``uint8`` array with the blob codecs (uncompressed, crc32c); a ``zarr.json``
    that declares another type or other codecs fails to open."""
    return {"driver": "zarr3", "kvstore": dict(kvstore), "rank": 1, **ALWAYS,
            "metadata": {"data_type": "uint8", "codecs": [dict(c) for c in zarr_json.BLOB_CODECS]}}


def check_blob(opening: ts.Future) -> ts.Future:
    """A future of the array ``opening`` opens, once its single chunk is known to hold all the bytes ``zarr.json``
    declares: the chunk is exactly ``n + 4`` bytes, and probing one byte stops a crafted ``zarr.json`` that
    declares a huge length from making the reader allocate it."""
    promise, out = ts.Promise.new()

    def opened(f: ts.Future) -> None:
        try:
            array = f.result()
            n = array.shape[0]
            if array.chunk_layout.write_chunk.shape != (max(n, 1),):
                raise ValueError(f"a value blob is one chunk of its whole length {n}, "
                                 f"not chunks of {list(array.chunk_layout.write_chunk.shape)}")
            if n == 0:
                promise.set_result(array)
                return
            key = zarr_json.chunk_key((0,), zarr_json.chunk_key_separator(array.spec().to_json().get("metadata", {})))
            last = n + zarr_json.BLOB_CHECKSUM_BYTES - 1
            array.kvstore.read(key, byte_range=slice(last, last + 1)).add_done_callback(
                lambda g: probed(g, array, key, n))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            promise.set_exception(e)

    def probed(f: ts.Future, array: ts.TensorStore, key: str, n: int) -> None:
        try:
            f.result()
        except ValueError as e:
            if "OUT_OF_RANGE" not in str(e):
                promise.set_exception(e)
                return
            promise.set_exception(ValueError(f"chunk {key} holds fewer bytes than the {n} its zarr.json declares"))
            return
        promise.set_result(array)  # a missing chunk is reported by the read itself

    opening.add_done_callback(opened)
    return out


@dataclasses.dataclass(frozen=True)
class Store(OpenedLocation):
    """A checkpoint location opened in this process: one context, its root kvstore, its layout (after reading the
    metadata, :meth:`for_checkpoint` switches to the layout the checkpoint was written with)."""

    layout: KvLayout = dataclasses.field(default_factory=lambda: get_layout(PACKED))

    @classmethod
    def open(cls, location: LocationLike, *, io_concurrency: int = DEFAULT_IO_CONCURRENCY,
             layout: str = PACKED, sync: bool = True) -> Store:
        loc = parse_location(location)
        kv_layout = get_layout(layout)
        context = kv_layout.context(make_context(io_concurrency, loc, sync=sync))
        return cls(loc, context, open_kvstore(loc, context), kv_layout, sync=sync, io_concurrency=io_concurrency)

    def for_checkpoint(self, metadata: CheckpointMetadata) -> Store:
        layout = layout_for(metadata)
        context = self.context if layout is self.layout else layout.context(self.context)
        return dataclasses.replace(self, layout=layout, context=context)

    def array_kvstore(self, path: str) -> dict[str, Any]:
        return self.layout.array_kvstore(self.location, path)

    def open_blob(self, path: str) -> ts.Future:
        """Open a value blob for reading, checked to hold as many bytes as it declares."""
        return check_blob(ts.open(blob_read_spec(self.array_kvstore(path)), context=self.context, open=True, read=True))

    def node_kvstore(self, path: str) -> ts.KvStore:
        """The kvstore holding the node (array or group) at ``path``: its ``zarr.json`` and chunk keys."""
        try:
            return ts.KvStore.open(self.array_kvstore(path), context=self.context).result()
        except ValueError as e:
            raise storage_error(e, f"cannot open {self.url}/{path}") from None


def read_error(key: str, url: str, e: Exception) -> TsckptError:
    """The error for a tensor whose array could not be opened or read (TensorStore's text names the chunk)."""
    return StorageError(f"reading tensor {key!r} from {url} failed: {problem(e)}")
