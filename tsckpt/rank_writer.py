"""One rank's writes into a save: arrays opened, chunks and value blobs written, checksummed, awaited.

Both save pipelines write through :class:`RankWriter`: every rank of a DCP save
(:class:`tsckpt.TensorStoreWriter`) and the one-process
:class:`~tsckpt.conversion.builder.CheckpointBuilder`. What an array looks like
(its path, grid and codecs) is decided before it gets here; this module only
moves bytes and remembers what it wrote:

* arrays are opened before their ``zarr.json`` exists (:meth:`Store.create`,
  TensorStore's ``assume_metadata``), through the layout's transaction batches
  (:class:`~tsckpt.storage.batch.RankBatch`);
* arrays with inner chunks and uncompressed data (the default) are encoded
  here (:mod:`tsckpt.format.shards`, which yields each inner chunk's crc32c on
  the way) and written as whole chunk keys through a ``uint8`` view of them
  (:meth:`Store.create_raw`), or, for a plain checkpoint on a local disk, as
  files from a few recycled buffers
  (:class:`~tsckpt.storage.chunk_files.ChunkFileWriter`), which there also
  writes the uncompressed arrays without inner chunks; every other array
  through TensorStore's ``zarr3`` driver;
* every piece of a tensor's checksum grid written (its inner chunks) gets its
  crc32c (:mod:`tsckpt.format.checksums`), every outer chunk its content hash
  (:mod:`tsckpt.format.content_hashes`), kept per tensor in
  :attr:`RankWriter.written`;
* given a base checkpoint (:class:`~tsckpt.base_chunks.BaseChunks`), a chunk
  with the base's content hash is not written: the base's copy is read back,
  checked (:meth:`~tsckpt.base_chunks.BaseChunks.sound`), and taken; one that
  fails is written after all;
* host copies of device tensors, and with ``bound_host_sources`` every source,
  pass through one :class:`~tsckpt.dcp.copy_window.CopyWindow`, which bounds
  the host memory a rank holds while TensorStore works.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .dcp.copy_window import CopyWindow
from .errors import StorageError
from .format import checksums, content_hashes, dtypes, shard_encoding, shards, zarr_json
from .storage import chunk_files
from .storage.batch import RankBatch
from .storage.kvio import problem
from .format.grid import ChunkGrid
from .format.metadata import ArrayOptions, TensorEntry
from .storage.store import Store

if TYPE_CHECKING:
    from .base_chunks import BaseChunks


def region(offsets: Sequence[int], sizes: Sequence[int]) -> tuple[slice, ...]:
    """The box of an array at ``offsets`` of ``sizes``, as slices."""
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes))


#: Bytes of base chunks a rank reads back at once to check them before taking them.
CHECK_WINDOW = 256 << 20


@dataclass
class WrittenChunks:
    """The outer chunks of one tensor this rank saved, by flat grid index.

    With checksums: each chunk's content hash, and the crc32c of every piece of
    the tensor's checksum grid those chunks hold (``pieces``: flat indices in
    that grid, ``crcs`` beside them). ``reused`` marks the chunks taken from
    the base rather than written (empty without a base).
    """

    indices: list[int] = field(default_factory=list)
    digests: list[bytes] = field(default_factory=list)
    reused: list[bool] = field(default_factory=list)
    pieces: list[int] = field(default_factory=list)
    crcs: list[int] = field(default_factory=list)


def chunk_sums(source: np.ndarray, grid: ChunkGrid, offsets: Sequence[int]) -> Iterator[
        tuple[tuple[int, ...], tuple[slice, ...], int, bytes]]:
    """Every chunk of a region written at ``offsets``: grid index, slice of ``source``, crc32c, content hash."""
    for index, view in grid.chunks_within(offsets, source.shape):
        yield index, view, *content_hashes.crc_and_digest(source[view])


def _start(grid: ChunkGrid, index: Sequence[int]) -> list[int]:
    return [r.start for r in grid.chunk_region(index)]


class RankWriter:
    """Write one rank's chunks and blobs into ``store``; see the module docstring.

    Call :meth:`open` with the arrays the rank will write, then :meth:`write`
    and :meth:`write_blob` in any order, then :meth:`finish` once: it returns
    when every write is durable (committed, for layouts with transactions).

    Args:
        store: where this save's data goes (its staging location, or in place).
        rank: the rank writing (the packed layout gives each rank a database).
        where: the checkpoint, as named in errors; empty where the caller names it (a DCP save's
            coordinator reports a rank's failure with the location and the rank).
        options: the codecs of every tensor array.
        checksums: compute a crc32c of every outer chunk written.
        window: bytes of host data kept in flight (:class:`CopyWindow`'s limit;
            None: no bound).
        bound_host_sources: pass CPU sources through the window too, releasing
            each once written (a converter that must not hold every tensor);
            otherwise CPU sources stay referenced until :meth:`finish`, and
            their checksums are computed there while TensorStore's threads write.
        base: the base checkpoint of an incremental save, whose equal chunks are
            taken instead of written.
    """

    def __init__(self, store: Store, rank: int, where: str, *, options: ArrayOptions, checksums: bool,
                 window: int | None, bound_host_sources: bool = False, base: BaseChunks | None = None):
        self.store = store
        self.rank = rank
        self.where = where
        self.options = options
        self.checksums = checksums
        self.bound_host_sources = bound_host_sources
        self.written: dict[str, WrittenChunks] = {}
        self._entries: dict[str, TensorEntry] = {}
        self._opened: dict[str, Any] = {}
        self._formats: dict[str, shards.ShardFormat | None] = {}
        #: Arrays whose encoded chunks this rank writes as files itself (a plain checkpoint on a local disk).
        self._files: dict[str, str] = {}
        self._file_writer = chunk_files.ChunkFileWriter(sync=store.location.context.get("file_io_sync") is not False)
        self._pending: list[tuple[str, Any]] = []
        #: Chunks written as files whose crc32c values come with their futures: where to record them.
        self._crcs_due: list[tuple[WrittenChunks, np.ndarray, Any]] = []
        self._later: list[tuple[str, Sequence[int], np.ndarray]] = []
        self._held: list[Any] = []
        self._window = CopyWindow(window)
        self._batch = RankBatch(store.layout, self._drain, where)
        self.base = base
        self._checks = CopyWindow(CHECK_WINDOW)

    def open(self, entries: Mapping[str, TensorEntry]) -> None:
        """Start opening the arrays of ``entries`` (flat key -> entry), all at once."""
        for fqn, e in entries.items():
            self._entries[fqn] = e
            directory = chunk_files.local_directory(self.store, e.path)
            # Chunk files written here include small arrays': no TensorStore open for each.
            fmt = self._formats[fqn] = shards.file_format(e, self.options, directory is not None)
            if directory is not None and fmt is not None:
                self._files[fqn] = directory
            elif fmt is None:
                self._opened[fqn] = self.store.create(e.path, zarr_json.tensor_metadata(e, self.options), self.rank)
            else:
                self._opened[fqn] = self.store.create_raw(e.path, e.grid.grid_shape, fmt.nbytes, self.rank)

    def write(self, fqn: str, offsets: Sequence[int], data: Any) -> int:
        """Start writing ``data`` (a torch tensor or numpy array) at ``offsets`` of tensor ``fqn``; its byte count.

        The data must not change until :meth:`finish` returns. A device tensor
        is copied to host memory first, within the window; chunks encoded here
        pass through the window too (their encoded copies live until written).
        """
        nbytes, copied = self._host_bytes(data)
        # Chunks encoded into TensorStore writes live until written; those written as files, in a few buffers.
        windowed = copied or self.bound_host_sources or (self._formats[fqn] is not None and fqn not in self._files)
        if windowed:
            self._window.admit(nbytes)
        source, hold = self._as_numpy(data)
        chunks = self.written.setdefault(fqn, WrittenChunks())
        if not source.size:
            return nbytes
        against = self.base.tables(fqn, self._entries[fqn]) if self.base is not None else None
        if against is not None:
            futures = self._write_against(fqn, offsets, source, chunks, against)
        else:
            futures = self._write_box(fqn, offsets, source, chunks)
        if windowed:
            if against is None:  # checksum now: the window may release the source once it is written
                self._checksum(fqn, chunks, offsets, source)
            self._window.add(nbytes, lambda: [self._wait(fqn, f) for f in futures], hold=hold)
        else:
            self._held.append(hold)
            if against is None:
                self._later.append((fqn, offsets, source))
        return nbytes

    def _write_box(self, fqn: str, offsets: Sequence[int], source: np.ndarray,
                   chunks: WrittenChunks | None) -> list[Any]:
        """Start writing ``source`` (whole outer chunks) at ``offsets``; its futures.

        Chunks encoded here record their inner chunks' crc32c into ``chunks``
        (None: already recorded), when checksums are on.
        """
        fmt = self._formats[fqn]
        if fqn in self._files:
            return self._write_files(fqn, offsets, source, chunks)
        arr = self._batch.bind(self._opened[fqn].result())
        if fmt is None:
            futures = [arr[region(offsets, source.shape)].write(source, can_reference_source_data_indefinitely=True)]
        else:
            futures = []
            for index, encoded, pieces, crcs in shard_encoding.encode_region(fmt, self._entries[fqn].shape, offsets, source):
                at = (*index[:-1], slice(index[-1] * fmt.nbytes, (index[-1] + 1) * fmt.nbytes))
                futures.append(arr[at].write(encoded, can_reference_source_data_indefinitely=True))
                if chunks is not None and self.checksums:
                    chunks.pieces += pieces.tolist()
                    chunks.crcs += crcs
        self._pending += [(fqn, fut) for fut in futures]
        self._batch.wrote(fqn, source.nbytes)
        return futures

    def _write_files(self, fqn: str, offsets: Sequence[int], source: np.ndarray,
                     chunks: WrittenChunks | None) -> list[Any]:
        """:meth:`_write_box` for an array whose chunk files this rank writes itself."""
        fmt, directory, shape = self._formats[fqn], self._files[fqn], self._entries[fqn].shape
        assert fmt is not None
        futures = []
        for index, part in shard_encoding.region_chunks(fmt, shape, offsets, source):
            fut = self._file_writer.write(os.path.join(directory, zarr_json.chunk_key(index)), fmt, part)
            futures.append(fut)
            if chunks is not None and self.checksums:
                self._crcs_due.append((chunks, shard_encoding.pieces_of(fmt, shape, index, part.shape), fut))
        self._pending += [(fqn, fut) for fut in futures]
        return futures

    def _write_against(self, fqn: str, offsets: Sequence[int], source: np.ndarray, chunks: WrittenChunks,
                       base: tuple[np.ndarray, np.ndarray]) -> list[Any]:
        """Write the chunks of a region whose content hash differs from the base's; check and take the others.

        An unchanged chunk's crc32c values are the base's (its checksum grid is
        ours, :meth:`BaseChunks.tables`): the content is the same, so only the
        (faster) content hash is computed for it. A changed chunk encoded here
        gets its crc32c values from the encoding.
        """
        crcs, digests = base
        entry = self._entries[fqn]
        grid, units = entry.grid, entry.checksum_grid
        encoded = self._formats[fqn] is not None
        changed, seen = [], 0
        for index, view in grid.chunks_within(offsets, source.shape):
            seen += 1
            part = np.ascontiguousarray(source[view])
            flat, digest = grid.flat_index(index), content_hashes.digest(part)
            same = digest == digests[flat].tobytes()
            chunks.indices.append(flat)
            chunks.digests.append(digest)
            chunks.reused.append(same)
            if same or not encoded:
                pieces = units.flat_indices_within(_start(grid, index), part.shape)
                chunks.pieces += pieces.tolist()
                chunks.crcs += crcs[pieces].tolist() if same else \
                    checksums.region_checksums(part, units, _start(grid, index))[1]
            if same:
                self._check_then_take(fqn, index, len(chunks.reused) - 1, part)
            else:
                changed.append((index, view))
        if len(changed) == seen:  # nothing to take: one write, as without a base
            return self._write_box(fqn, offsets, source, chunks)
        return [f for index, view in changed for f in self._write_box(fqn, _start(grid, index), source[view], chunks)]

    def _check_then_take(self, fqn: str, index: tuple[int, ...], position: int, part: np.ndarray) -> None:
        """Read the base's chunk back; take it if it is still sound, else write ``part`` after all.

        The reads run on TensorStore's threads while this rank goes on; each is
        checked once the window of reads in flight is full, or at the end.
        """
        assert self.base is not None
        self._checks.admit(part.nbytes)
        reading = self.base.read(fqn, index)
        self._checks.add(part.nbytes, lambda: self._settle(fqn, index, position, part, reading))

    def _settle(self, fqn: str, index: tuple[int, ...], position: int, part: np.ndarray, reading: Any) -> None:
        assert self.base is not None
        chunks, entry = self.written[fqn], self._entries[fqn]
        if self.base.sound(fqn, index, reading, chunks.digests[position]) and self.base.take(entry, index):
            return
        chunks.reused[position] = False
        self._write_box(fqn, _start(entry.grid, index), part, None)  # its crc32c values are recorded

    def write_blob(self, name: str, path: str, payload: bytes) -> None:
        """Start writing a value blob (``torch.save`` bytes) as the ``uint8`` array at ``path``."""
        blob = np.frombuffer(payload, dtype=np.uint8)
        if self.bound_host_sources:
            self._window.admit(blob.size)
        arr = self._batch.bind(self.store.create(path, zarr_json.blob_metadata(blob.size), self.rank).result())
        self._batch.wrote(name, blob.size)
        fut = arr.write(blob)
        self._pending.append((name, fut))
        if self.bound_host_sources:
            self._window.add(blob.size, lambda: self._wait(name, fut), hold=blob)

    def finish(self) -> None:
        """Checksum what is left, wait for every write, commit the last batch."""
        # TensorStore's threads write meanwhile: the checksums cost CPU, not wall time.
        for fqn, offsets, source in self._later:
            self._checksum(fqn, self.written[fqn], offsets, source)
        self._later.clear()
        self._checks.drain()
        self._window.drain()
        self._drain()
        try:
            self._file_writer.finish()
        except OSError as e:
            raise StorageError(f"{problem(e)} making the chunk files durable"
                               + (f" in {self.where}" if self.where else "")) from e
        self._batch.commit()
        self._held.clear()

    def flush(self) -> None:
        """Wait until every write started so far is done (not committed: see :meth:`finish`)."""
        self._checks.drain()
        self._window.drain()
        self._drain()

    def abandon(self) -> None:
        """After a failure: wait for started writes, ignoring their errors, so no I/O outlives its source."""
        for _, fut in self._pending:
            try:
                fut.result()
            except Exception:
                pass
        self._pending.clear()
        self._crcs_due.clear()
        self._window = CopyWindow(self._window.limit)
        self._checks = CopyWindow(CHECK_WINDOW)
        self._held.clear()

    def _checksum(self, fqn: str, chunks: WrittenChunks, offsets: Sequence[int], source: np.ndarray) -> None:
        """Record the outer chunks of a region written without a base: indices, content hashes, crc32c values.

        Chunks encoded here recorded their crc32c values already; where the
        checksum grid is the chunk grid, one pass computes both sums.
        """
        entry = self._entries[fqn]
        grid, units = entry.grid, entry.checksum_grid
        if not self.checksums:
            chunks.indices += grid.flat_indices_within(offsets, source.shape).tolist()
            return
        if self._formats[fqn] is None and units.chunk_shape == grid.chunk_shape:
            for index, _, crc, digest in chunk_sums(source, grid, offsets):
                chunks.indices.append(grid.flat_index(index))
                chunks.pieces.append(grid.flat_index(index))
                chunks.crcs.append(crc)
                chunks.digests.append(digest)
            return
        for index, view in grid.chunks_within(offsets, source.shape):
            chunks.indices.append(grid.flat_index(index))
            chunks.digests.append(content_hashes.digest(source[view]))
        if self._formats[fqn] is None:
            pieces, crcs = checksums.region_checksums(source, units, offsets)
            chunks.pieces += pieces
            chunks.crcs += crcs

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

    def _drain(self) -> None:
        for name, fut in self._pending:
            self._wait(name, fut)
        self._pending.clear()
        for chunks, pieces, fut in self._crcs_due:
            chunks.pieces += pieces.tolist()
            chunks.crcs += fut.result()
        self._crcs_due.clear()

    def _wait(self, name: str, fut: Any) -> None:
        try:
            fut.result()
        except Exception as e:
            raise StorageError(f"{problem(e)} writing {name!r}" + (f" to {self.where}" if self.where else "")) from e
