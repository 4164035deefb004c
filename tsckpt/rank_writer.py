"""One rank's writes into a save: every outer chunk and value blob encoded once and stored through one sink.

Every rank of a DCP save (:class:`tsckpt.TensorStoreWriter`) and the one-process
:class:`~tsckpt.conversion.builder.CheckpointBuilder` write through :class:`RankWriter`. An array's path, grid
and codecs are decided before it gets here; this module moves bytes and remembers what it wrote:

* each outer chunk becomes one value (:class:`~tsckpt.format.shard_encoding.EncodedChunk`, or
  :class:`~tsckpt.format.compressed.CompressedChunk`), a value blob its bytes and a crc32c, put into the
  layout's :class:`~tsckpt.storage.sinks.Sink` under its Zarr key;
* each outer chunk's content hash goes into the rank's chunk table (:mod:`tsckpt.format.chunk_table`);
* a chunk with the base's content hash (:class:`~tsckpt.base_chunks.BaseChunks`) is read back from the base,
  checked and taken instead of written; one that fails the check is written after all;
* device copies, and with ``bound_host_sources`` every source, pass through one
  :class:`~tsckpt.dcp.copy_window.CopyWindow`, which bounds a rank's host memory, and are written as they
  come; other host sources are written at :meth:`RankWriter.finish`, in :mod:`tsckpt.format.band_order`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .dcp.copy_window import CopyWindow
from .errors import StorageError
from .format import band_order, content_hashes, dtypes, shards, zarr_json
from .format.compressed import CompressedChunk
from .format.data_files import RankFiles
from .format.chunk_table import ChunkTable
from .format.metadata import ArrayOptions, TensorEntry
from .format.ocdbt import Ref
from .format.shard_encoding import EncodedChunk
from .storage.kvio import problem
from .storage.byte_writes import Blob, WriteFailed
from .storage.store import Store

if TYPE_CHECKING:
    from .base_chunks import BaseChunks


#: Bytes of base chunks a rank reads back at once to check them before taking them.
CHECK_WINDOW = 256 << 20


@dataclass
class WrittenChunks:
    """The outer chunks of one tensor this rank saved, by flat grid index, in the order they were saved.

    ``refs[k]``: where chunk ``indices[k]`` is stored (packed, after :meth:`RankWriter.finish`); ``reused[k]``:
    it was taken from the base instead of written.
    """

    indices: list[int] = field(default_factory=list)
    digests: list[bytes] = field(default_factory=list)
    reused: list[bool] = field(default_factory=list)
    refs: list[Ref | None] = field(default_factory=list)


class RankWriter:
    """Write one rank's chunks and blobs into ``store``: :meth:`open` the arrays, then :meth:`write` and
    :meth:`write_blob` in any order, then :meth:`finish` once, which returns when every write is durable.

    Args:
        store: where this save's data goes (its staging location, or in place).
        rank: the rank writing (its data file and chunk table are its own).
        save_id: the save, which names the rank's files.
        where: the checkpoint, as named in errors; empty where the caller names it.
        options: the codecs of every tensor array.
        checksums: record each outer chunk's content hash (the inner chunks' crc32c is a codec).
        window: bytes of host data kept in flight (:class:`CopyWindow`'s limit; None: no bound).
        bound_host_sources: pass CPU sources through the window too, releasing each once written (a converter
            that must not hold every tensor); otherwise CPU sources stay referenced until :meth:`finish`.
        base: the base of an incremental save, whose equal chunks are taken instead of written.
        sync: make the data durable (fsync) before :meth:`finish` returns.
    """

    def __init__(self, store: Store, rank: int, save_id: str, where: str, *, options: ArrayOptions,
                 checksums: bool, window: int | None, bound_host_sources: bool = False,
                 base: BaseChunks | None = None, sync: bool = True):
        self.where = where
        self.options = options
        self.checksums = checksums
        self.bound_host_sources = bound_host_sources
        self.written: dict[str, WrittenChunks] = {}
        #: Each value blob's key and, in the packed layout, where it is stored (after :meth:`finish`).
        self.blobs: dict[str, Ref | None] = {}
        self._blob_paths: dict[str, str] = {}
        self._entries: dict[str, TensorEntry] = {}
        #: What each array path holds, by name: for errors, which name keys and not names.
        self._names: dict[str, str] = {}
        self._formats: dict[str, shards.ShardFormat] = {}
        self._sink = store.layout.sink(store, rank, save_id, sync=sync, hashed=checksums)
        self._banded = store.layout.bands(store.location)
        #: What each value put into the sink was: (tensor, position in its WrittenChunks) or (blob name, -1).
        self._puts: list[tuple[str, int]] = []
        #: Values of host sources not yet put, where tensors are banded: put at :meth:`finish` in placement order.
        self._deferred: list[tuple[tuple[float | int, ...], str, tuple[int, ...], int, Any, Any]] = []
        self._seq: dict[str, int] = {}
        self._held: list[Any] = []
        self._window = CopyWindow(window)
        self.base = base
        self._checks = CopyWindow(CHECK_WINDOW)

    def open(self, entries: Mapping[str, TensorEntry]) -> None:
        """Take the arrays of ``entries`` (flat key -> entry) this rank will write."""
        for fqn, e in entries.items():
            self._entries[fqn] = e
            self._names[e.path] = fqn
            self._formats[fqn] = shards.value_format(e, self.options)

    def write(self, fqn: str, offsets: Sequence[int], data: Any) -> int:
        """Store ``data`` (a torch tensor or numpy array) at ``offsets`` of tensor ``fqn``; its byte count.

        The data must not change until :meth:`finish` returns; a device tensor is copied to host memory first,
        within the window."""
        nbytes, copied = self._host_bytes(data)
        windowed = copied or self.bound_host_sources
        if windowed:
            self._window.admit(nbytes)
        source, hold = self._as_numpy(data)
        chunks = self.written.setdefault(fqn, WrittenChunks())
        if not source.size:
            return nbytes
        entry = self._entries[fqn]
        against = self.base.digests(fqn, entry) if self.base is not None else None
        # Sources that stay in host memory until finish() are put there, in placement order (one file, laid
        # out for loads into other topologies); device copies are written as they come, within the window.
        defer = self._banded and not windowed and self.options.compression is None
        seq = self._seq.setdefault(fqn, len(self._seq))
        futures = []
        for index, view in entry.grid.chunks_within(offsets, source.shape):
            part = source[(*view, ...)]  # an array even for a 0-d tensor's one chunk
            flat = entry.grid.flat_index(index)
            chunks.indices.append(flat)
            chunks.reused.append(False)
            chunks.refs.append(None)
            position = len(chunks.indices) - 1
            value = self._value(fqn, part)
            # A chunk is hashed as it is written; one that may be the base's is hashed first, to decide.
            digest = content_hashes.stored_value(value) if against is not None else b""
            chunks.digests.append(digest)
            if against is not None and against.get(flat) == digest:
                self._check_then_take(fqn, index, position, part)
            elif defer:
                self._deferred.append((band_order.sort_key(entry.grid, index, seq), fqn, index, position, value, hold))
            else:
                futures.append(self._put(fqn, index, position, value, hold, background=copied))
        if windowed:
            self._window.add(nbytes, lambda: self._wait(futures), hold=hold)
        else:
            self._held.append(hold)
        return nbytes

    def _value(self, fqn: str, part: np.ndarray) -> Any:
        """Outer chunk ``part`` (its part inside the array) as the value stored for it."""
        fmt = self._formats[fqn]
        return (CompressedChunk(fmt, part, self.options.compression) if self.options.compression is not None
                else EncodedChunk(fmt, part))

    def _put(self, fqn: str, index: tuple[int, ...], position: int, value: Any, hold: Any,
             background: bool = False) -> Any:
        """Hand outer chunk ``index`` of ``fqn``, encoded as ``value``, to the sink (``background``: while this
        rank copies more device tensors to host memory)."""
        key = f"{self._entries[fqn].path}/{zarr_json.chunk_key(index)}"
        self._puts.append((fqn, position))
        try:
            return self._sink.put(key, value, hold, background)
        except (WriteFailed, OSError) as e:
            raise self._failed(e) from e

    def _check_then_take(self, fqn: str, index: tuple[int, ...], position: int, part: np.ndarray) -> None:
        """Read the base's chunk back; take it if it is still sound, else write ``part`` after all. The reads run
        on the reading threads; each is checked once the window of reads in flight is full, or at the end."""
        assert self.base is not None
        self._checks.admit(part.nbytes)
        reading = self.base.read(fqn, index)
        self._checks.add(part.nbytes, lambda: self._settle(fqn, index, position, part, reading))

    def _settle(self, fqn: str, index: tuple[int, ...], position: int, part: np.ndarray, reading: Any) -> None:
        assert self.base is not None
        chunks, entry = self.written[fqn], self._entries[fqn]
        sound = self.base.sound(fqn, entry, index, reading, chunks.digests[position])
        taken = self.base.take(fqn, entry, index, reading) if sound else None
        if taken is not None:
            chunks.reused[position] = True
            chunks.refs[position] = taken if isinstance(taken, Ref) else None
            return
        self._held.append(part)
        self._put(fqn, index, position, self._value(fqn, part), part)

    def _put_deferred(self) -> None:
        """Put the deferred values, in the order of :func:`~tsckpt.format.band_order.sort_key`."""
        deferred, self._deferred = self._deferred, []
        deferred.sort(key=lambda d: d[0])
        self._sink.expect(sum(d[4].nbytes for d in deferred))
        for _, fqn, index, position, value, hold in deferred:
            self._put(fqn, index, position, value, hold)

    def write_blob(self, name: str, path: str, payload: bytes) -> None:
        """Store a value blob (``torch.save`` bytes) as the one chunk of the ``uint8`` array at ``path``."""
        self.blobs[name] = None
        self._blob_paths[name] = path
        self._names[path] = name
        self._puts.append((name, -1))
        self._sink.put(f"{path}/{zarr_json.chunk_key((0,))}", Blob(payload), payload)

    def flush(self) -> None:
        """Wait until the sources of every write started so far may be released (not durable: see :meth:`finish`)."""
        self._checks.drain()
        self._window.drain()
        self._put_deferred()

    def finish(self) -> RankFiles:
        """Wait for every write, store the chunk table, make everything durable; what the rank's files hold."""
        self.flush()
        try:
            files = self._sink.finish(self._collect)
        except WriteFailed as e:
            raise self._failed(e) from e
        except (OSError, ValueError) as e:
            raise StorageError(f"{problem(e)} making the rank's data durable"
                               + (f" in {self.where}" if self.where else "")) from e
        if self.base is not None:  # the base's data files this rank linked in are the new checkpoint's too
            files = RankFiles(files.files + tuple(self.base.linked_files()), files.table)
        self._held.clear()
        return files

    def _collect(self) -> bytes | None:
        """Once every value is written: where each is, its content hash, and so the chunk table (if any)."""
        refs = self._sink.refs
        blob_digests: dict[str, bytes] = {}
        for k, (name, position) in enumerate(self._puts):
            if position < 0:
                self.blobs[name] = refs[k] if refs is not None else None
                if self._sink.hashed:
                    blob_digests[name] = self._sink.digests[k]
                continue
            if refs is not None:
                self.written[name].refs[position] = refs[k]
            if self._sink.hashed:
                self.written[name].digests[position] = self._sink.digests[k]
        return self._chunk_table(blob_digests)

    def _chunk_table(self, blob_digests: Mapping[str, bytes]) -> bytes | None:
        """The rank's chunk table: where each value is (packed), its content hash (with checksums); None
        where there is neither (a plain save without checksums)."""
        located = self._sink.refs is not None
        if not (located or self.checksums):
            return None
        arrays: list[str] = []
        chunks: list[int] = []
        refs: list[Ref | None] = []
        digests: list[bytes] = []
        for fqn, written in self.written.items():
            arrays += [self._entries[fqn].path] * len(written.indices)
            chunks += written.indices
            refs += written.refs
            digests += written.digests
        for name, ref in self.blobs.items():
            arrays.append(self._blob_paths[name])
            chunks.append(0)
            refs.append(ref)
            digests.append(blob_digests.get(name, b""))
        files: dict[str, int] = {}
        where = None
        if located:
            assert all(r is not None for r in refs), "a packed value without a place"
            where = [(files.setdefault(r.path, len(files)), r.offset, r.length) for r in refs if r is not None]
        return ChunkTable.of(arrays, chunks, files=list(files), where=where,
                             digests=digests if self.checksums else None).encode()

    def _wait(self, futures: list[Any]) -> None:
        for f in futures:
            if f is not None:
                try:
                    f.result()
                except WriteFailed as e:
                    raise self._failed(e) from e

    def _failed(self, e: BaseException) -> StorageError:
        """One line naming the tensor (or value) whose write failed, and why."""
        key, cause = (e.key, e.cause) if isinstance(e, WriteFailed) else ("", e)
        path = key.rsplit("/", 1)[0]
        name = self._names.get(path, key)
        return StorageError(f"{problem(cause)} writing {name!r}" + (f" to {self.where}" if self.where else ""))

    def abandon(self) -> None:
        """After a failure: wait for started writes, ignoring their errors, so no I/O outlives its source."""
        self._sink.abandon()
        self._window = CopyWindow(self._window.limit)
        self._checks = CopyWindow(CHECK_WINDOW)
        self._deferred.clear()
        self._held.clear()

    @staticmethod
    def _host_bytes(data: Any) -> tuple[int, bool]:
        """The byte count of ``data`` and whether it must be copied to host memory first."""
        if isinstance(data, np.ndarray):
            return data.nbytes, False
        return data.numel() * data.element_size(), data.device.type != "cpu"

    @staticmethod
    def _as_numpy(data: Any) -> tuple[np.ndarray, Any]:
        """A numpy view of ``data`` (copied to host memory if on a device), and what must stay referenced."""
        if isinstance(data, np.ndarray):
            return data, data
        tensor = data.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        return dtypes.tensor_as_numpy(tensor), tensor
