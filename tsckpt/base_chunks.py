"""The base of an incremental save: which of its chunks a rank may take instead of writing them.

A save given a base (``tsckpt.save(..., base=B)``) compares each outer chunk it
is about to write with the same chunk of the same array in ``B``: same path,
shape, data type, chunk grid, inner chunks and codecs, and an equal 128-bit
content hash (:mod:`tsckpt.format.content_hashes`). Such a chunk is taken from
the base only after the base's stored copy is read back and still passes the
checks every read of the base makes, so a damaged chunk of the base is written
afresh instead. Chunks tsckpt encodes itself (inner chunks, no compression: the
default) are checked as stored, without decoding: their size, their shard index
and the crc32c of every inner chunk (:func:`tsckpt.format.shards.check_stored`),
one sequential read and one crc32c pass each. Other chunks are read through
TensorStore's codecs and must still have the content hash.

How a chunk is taken depends on where the checkpoints live, and in each case
the new checkpoint stands alone (``docs/format.md``, section 8):

* **plain layout, local filesystem**: the base's chunk file is hard-linked
  into the new checkpoint. No bytes are copied; deleting the base leaves the
  new checkpoint whole; files are only ever replaced, never written in place,
  so neither checkpoint can change the other.
* **packed layout, local filesystem**: the rank only reports the chunk; the
  coordinator's join starts the new database from a hard-linked copy of the
  base's (:mod:`tsckpt.storage.packed_reuse`), keeping the OCDBT references of
  the chunks taken.
* **object stores, memory, or a base in another layout**: nothing is taken
  (TensorStore has no server-side copy, and OCDBT references cannot leave a
  database's own prefix); the save writes everything and says why.

:func:`choose_base` runs once, on the coordinator; :class:`BaseChunks` on every rank.
"""

from __future__ import annotations

import errno
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorstore as ts

from .errors import ChecksumError, OptionError, StorageError, TsckptError
from .format import checksums, content_hashes, dtypes, shards, zarr_json
from .commit import protocol as commit
from .storage.layouts import PLAIN
from .format.metadata import ArrayOptions, CheckpointMetadata, TensorEntry
from .storage.packed_reuse import KeptChunks
from .format.reuse import Reuse
from .storage import chunk_files
from .storage.store import Store, then
from .storage.location import Location, LocationLike, parse_location

#: How a rank takes a chunk from the base.
LINK, PACKED = "link", "packed"


@dataclass(frozen=True)
class BaseChoice:
    """What the coordinator decided about a save's base; sent to every rank with its plan.

    ``mode`` is :data:`LINK`, :data:`PACKED`, or None when nothing can be
    taken from this base (``note`` says why).
    """

    location: Location
    save_id: str | None
    mode: str | None
    note: str | None = None

    @property
    def url(self) -> str:
        return self.location.url


def previous(target: Location) -> Location | None:
    """The newest committed checkpoint beside ``target`` (in its parent directory or prefix), or None."""
    from .steps import latest  # steps reads roots of step checkpoints; imported when needed

    spec = dict(target.spec)
    path = str(spec.get("path", "")).rstrip("/")
    parent = path.rsplit("/", 1)[0] + "/" if "/" in path else ""
    if target.driver == "file":
        parent = os.path.dirname(os.path.abspath(path)) + "/"
    found = latest(Location({**spec, "path": parent}, target.context))
    return parse_location(found) if found is not None else None


def choose_base(target: Location, base: LocationLike | None, *, incremental: bool, layout: str,
                options: ArrayOptions, checksums_on: bool) -> BaseChoice | None:
    """Coordinator, before any rank writes: the base of this save, checked to be a committed checkpoint.

    ``base`` names it; ``incremental=True`` takes the newest committed
    checkpoint beside ``target`` instead (none: a full save). Raises before
    anything is written when ``base`` is not a committed checkpoint.
    """
    if base is not None and incremental:
        raise OptionError(f"saving {target.url}: pass base= or incremental=True, not both")
    location = parse_location(base) if base is not None else previous(target) if incremental else None
    if location is None:
        return None
    if not checksums_on:
        raise OptionError(f"saving {target.url} with base {location.url}: an incremental save needs "
                          f"checksums=True (unchanged chunks are found by their content hashes)")
    try:
        _, md = commit.open_committed(location)
    except TsckptError as e:
        raise type(e)(f"the base of the save to {target.url} is not a loadable checkpoint: {e}") from None
    save_id = md.extra.get("save_id") if isinstance(md.extra.get("save_id"), str) else None
    note = _unusable(target, location, md, layout, options)
    mode = None if note else (LINK if layout == PLAIN else PACKED)
    return BaseChoice(location, save_id, mode, note)


def _unusable(target: Location, base: Location, md: CheckpointMetadata, layout: str,
              options: ArrayOptions) -> str | None:
    """Why no chunk of ``base`` can be taken by a save into ``target``, or None."""
    if target.driver != "file" or base.driver != "file":
        return ("only checkpoints on a local filesystem share chunks (object stores have no server-side "
                "copy in TensorStore)")
    if md.layout != layout:
        return f"the base is in the {md.layout} layout, this save in the {layout} layout"
    if md.content_hash != content_hashes.ALGORITHM:
        return "the base records no content hashes (saved by an older tsckpt, or with checksums=False)"
    if md.array_options != options:
        return "the base was saved with other codecs (crc32c_codec or compression)"
    return None


class BaseChunks:
    """One rank's view of the base: the tables of arrays it may take chunks from, reads and links.

    Made from the coordinator's :class:`BaseChoice` with a usable mode; the
    rank reads the base's root document itself (one small read per rank).
    """

    def __init__(self, choice: BaseChoice, into: Store):
        assert choice.mode is not None
        self.choice = choice
        self.into = into
        self.store, self.metadata = commit.open_committed(choice.location, io_concurrency=4)
        self._tables: dict[str, tuple[np.ndarray, np.ndarray] | None] = {}
        self._arrays: dict[str, Any] = {}
        self._kvstores: dict[str, ts.Future] = {}

    @property
    def mode(self) -> str:
        assert self.choice.mode is not None
        return self.choice.mode

    def tables(self, fqn: str, entry: TensorEntry) -> tuple[np.ndarray, np.ndarray] | None:
        """The base's crc32c (per piece of its checksum grid) and content hash (per outer chunk) tables of
        ``fqn``, if its array is laid out and checksummed as ``entry``."""
        if fqn not in self._tables:
            found = self.metadata.tensors.get(fqn)
            same = found is not None and (found.path, found.shape, found.dtype, found.chunk_shape,
                                          found.inner_chunk_shape) == (entry.path, entry.shape, entry.dtype,
                                                                       entry.chunk_shape, entry.inner_chunk_shape)
            # The crc32c values of a chunk taken are the base's: they must cover the pieces ours do.
            same = same and found.checksum_grid.chunk_shape == entry.checksum_grid.chunk_shape
            if not same or found.checksums is None or found.content_hashes is None:
                self._tables[fqn] = None
            else:
                what = f"tensor {fqn!r} of the base {self.choice.url}"
                self._tables[fqn] = (checksums.decode_table(found.checksums, found.checksum_grid, what),
                                     content_hashes.decode_table(found.content_hashes, found.grid, what))
        return self._tables[fqn]

    def read(self, fqn: str, index: tuple[int, ...]) -> ts.Future:
        """Start reading chunk ``index`` of ``fqn`` from the base, to check it (:meth:`sound`) before it is taken.

        Chunks tsckpt encodes itself are read as stored: a plain base's chunk
        file read and checked unit by unit on the read threads (the future
        gives True, or raises), a packed base's one key each; others through
        TensorStore's codecs.
        """
        entry = self.metadata.tensors[fqn]
        fmt = self._format(entry)
        if fmt is not None:
            if self.mode == LINK:  # the chunk is a file: read and checked in small parts, on the read threads
                key = f"{entry.path}/{zarr_json.chunk_key(index)}"
                tables = self.tables(fqn, entry)
                assert tables is not None, "only chunks whose tables were compared are read"
                return chunk_files.submit(_check_file, os.path.join(_path(self.choice.location), key), entry, fmt,
                                          tables[0], index, f"tensor {fqn!r} of {self.choice.url}")
            kv = self._kvstores.get(fqn)
            if kv is None:
                kv = self._kvstores[fqn] = ts.KvStore.open(self.store.array_kvstore(entry.path),
                                                           context=self.store.context)
            key = zarr_json.chunk_key(index)
            return then(kv, lambda opened: opened.read(key))
        arr = self._arrays.get(fqn)
        if arr is None:
            arr = self._arrays[fqn] = self.store.open_tensor(entry).result()
        return arr[entry.grid.chunk_region(index)].read() if index else arr.read()

    def _format(self, entry: TensorEntry) -> shards.ShardFormat | None:
        """How the base's chunks of ``entry`` are checked as stored; chunk files of arrays without inner chunks
        too (:func:`~tsckpt.format.shards.leaf_format`), where they are files a link takes."""
        files = self.mode == LINK and entry.checksums_per_inner_chunk and entry.checksums is not None
        return shards.file_format(entry, self.metadata.array_options, files)

    def sound(self, fqn: str, index: tuple[int, ...], reading: ts.Future, digest: bytes) -> bool:
        """Whether the base's chunk that :meth:`read` started still holds what the base recorded: False when
        it is missing, truncated, replaced or any byte of it changed, so it must not be taken.

        A chunk read as stored is checked as any read checks it (its crc32c per
        inner chunk, the shard index, its size), on the stored bytes; one read
        through the codecs by its content hash ``digest``.
        """
        entry = self.metadata.tensors[fqn]
        fmt = self._format(entry)
        try:
            found = reading.result()
            if found is True:  # a chunk file, checked as it was read (_check_file)
                return True
            if fmt is None:
                return content_hashes.digest(found) == digest
            if found.state != "value":  # a kvstore read of a key that is missing
                return False
            data = found.value
            tables = self.tables(fqn, entry)
            assert tables is not None, "only chunks whose tables were compared are read"
            shards.check_stored(entry, fmt, tables[0], index, data, f"tensor {fqn!r} of {self.choice.url}")
        except (ValueError, ChecksumError):  # missing, undecodable or changed in the base: damaged
            return False
        return True

    def take(self, entry: TensorEntry, index: tuple[int, ...]) -> bool:
        """Make chunk ``index`` of ``entry`` part of the new checkpoint; False when it must be written instead.

        Plain layout: a hard link of the base's chunk file. Packed layout: the
        coordinator's join keeps it, so there is nothing to do here.
        """
        if self.mode == PACKED:
            return True
        key = f"{entry.path}/{zarr_json.chunk_key(index)}"
        source = os.path.join(_path(self.choice.location), key)
        dest = os.path.join(_path(self.into.location), key)
        try:
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            os.link(source, dest)
        except OSError as e:
            if e.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
                return False  # another filesystem, or one without (more) hard links: write it
            raise StorageError(f"linking chunk {key} of the base {self.choice.url} into {self.into.url} "
                              f"failed: {e.strerror}") from None
        return True


def _check_file(path: str, entry: TensorEntry, fmt: shards.ShardFormat, table: np.ndarray,
                index: tuple[int, ...], what: str) -> bool:
    """Check a base's chunk file as stored (:func:`tsckpt.format.shards.check_stored`), reading it one unit
    (:mod:`tsckpt.format.shard_encoding`) at a time into a reused buffer, not whole into fresh memory."""
    fd = chunk_files.open_read(path)
    try:
        size, tail = chunk_files.stored_tail(fd, path, fmt)
        shards.check_layout(fmt, index, size, tail, what)
        for first, unit in chunk_files.stored_units(fd, path, fmt):
            shards.check_stored_pieces(entry, fmt, table, index, unit, first, what)
    finally:
        os.close(fd)
    return True


def _path(location: Location) -> str:
    return str(location.spec.get("path", "")).rstrip("/")


def reuse_outcome(choice: BaseChoice | None, tensors: Mapping[str, TensorEntry],
                  reused: Mapping[str, np.ndarray], blob_bytes: int) -> tuple[Reuse | None, KeptChunks | None]:
    """Coordinator, at commit: the document's ``reuse`` record and, packed, the base's keys to keep.

    ``reused[fqn]`` marks, in row-major grid order, the chunks the ranks took from the base.
    """
    if choice is None:
        return None, None
    reused_bytes = reused_chunks = 0
    keys = []
    for fqn, entry in tensors.items():
        flat = np.flatnonzero(reused[fqn])
        if not len(flat):
            continue
        grid, itemsize = entry.grid, dtypes.from_zarr(entry.dtype).itemsize
        for i in flat.tolist():
            index = tuple(int(n) for n in np.unravel_index(i, grid.grid_shape)) if entry.shape else ()
            reused_bytes += math.prod(s.stop - s.start for s in grid.chunk_region(index)) * itemsize
            keys.append(f"{entry.path}/{zarr_json.chunk_key(index)}")
        reused_chunks += len(flat)
    written = sum(e.nbytes for e in tensors.values()) - reused_bytes + blob_bytes
    reuse = Reuse(choice.url, choice.save_id, reused_chunks, reused_bytes, written, choice.note)
    kept = KeptChunks(choice.location, tuple(sorted(keys))) if choice.mode == PACKED else None
    return reuse, kept
