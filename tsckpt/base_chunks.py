"""The base of an incremental save: which of its chunks a rank may take instead of writing them.

A save given a base (``tsckpt.save(..., base=B)``) takes an outer chunk from ``B`` when the same array there
has the same path, shape, data type, chunk grid, inner chunks and codecs, and the chunk the same 128-bit
content hash (:mod:`tsckpt.format.content_hashes`); only after ``B``'s stored copy is read back and passes
the checks every read of ``B`` makes, so a damaged chunk of the base is written afresh. Taking a chunk
hard-links ``B``'s file holding it (a data file, packed; a chunk file, plain) into the new checkpoint, which
stands alone; on object stores, or with a base in another layout or format version, nothing is taken
(``docs/format.md``, section 8).

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

from .errors import ChecksumError, OptionError, StorageError, TsckptError, UnsupportedVersionError
from .format import chunk_table, compressed, content_hashes, dtypes, shards, zarr_json
from .commit import protocol as commit
from .format.data_files import FileRef
from .format.metadata import ArrayOptions, CheckpointMetadata, TensorEntry
from .format.ocdbt import Ref
from .format.reuse import Reuse
from .storage.chunk_source import ChunkSource
from .storage.layouts import PLAIN
from .storage.store import Store
from .storage.location import Location, LocationLike, parse_location

#: How a rank takes a chunk from the base.
LINK, PACKED = "link", "packed"


@dataclass(frozen=True)
class BaseChoice:
    """What the coordinator decided about a save's base, sent to every rank with its plan: ``mode`` is
    :data:`LINK`, :data:`PACKED`, or None when nothing can be taken from it (``note`` says why)."""

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
    """Coordinator, before any rank writes: the base of this save (``base``, or with ``incremental=True`` the
    newest committed checkpoint beside ``target``; None: a full save); raises if it is not a committed one."""
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
    except UnsupportedVersionError:
        # Found beside the target by incremental=True after an upgrade: the first save writes everything.
        return BaseChoice(location, None, None, "the base is in a format version this tsckpt does not read")
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
    if md.content_hash != content_hashes.STORED_ALGORITHM:
        return "the base records no content hashes (saved with checksums=False)"
    if md.array_options != options:
        return "the base was saved with other codecs (crc32c_codec or compression)"
    return None


class BaseChunks:
    """One rank's view of the base (a :class:`BaseChoice` with a usable mode): its arrays' content hashes, reads
    of its chunks, and links to them. Each rank reads the base's root document itself, and of its chunk tables
    only the blocks holding the chunks it may take."""

    def __init__(self, choice: BaseChoice, into: Store):
        assert choice.mode is not None
        self.choice = choice
        self.into = into
        self.store, self.metadata = commit.open_committed(choice.location, io_concurrency=4)
        self.source = ChunkSource.of(self.store, self.metadata)
        files = self.metadata.data_files
        assert files is not None, "a committed checkpoint lists its data files"
        self._sizes = {f.path: f.size for f in files.files}
        self._writers: dict[str, np.ndarray] = {}
        self._linked: dict[str, bool] = {}

    def digests(self, fqn: str, entry: TensorEntry) -> _Digests | None:
        """The base's content hash of each outer chunk of ``fqn`` (by flat index), if its array is laid out
        as ``entry``'s: same path, shape, data type, chunk shape and inner chunk shape."""
        found = self.metadata.tensors.get(fqn)
        if found is None or (found.path, found.shape, found.dtype, found.chunk_shape, found.inner_chunk_shape) != (
                entry.path, entry.shape, entry.dtype, entry.chunk_shape, entry.inner_chunk_shape):
            return None
        return _Digests(self, found)

    def _lookup(self, entry: TensorEntry, flat: int) -> bytes | None:
        """The content hash the base's writer of chunk ``flat`` recorded, from the blocks of its chunk table that
        hold it (read once); None if there is none, or the table is unreadable or damaged: the chunk is then
        written afresh."""
        try:
            if entry.path not in self._writers:
                self._writers[entry.path] = entry.writer_ranks(self.metadata.world_size, f"the base {self.choice.url}")
            rank = int(self._writers[entry.path][flat])
            key = chunk_table.array_key(entry.path)
            rows = self.source.tables.look_up({rank: [(key, flat)]})[rank]
        except (ValueError, TsckptError):
            return None
        row = rows.get_key(key, flat)
        return row["digest"].tobytes() if row is not None and rows.hashed else None

    def read(self, fqn: str, index: tuple[int, ...]) -> Any:
        """Start reading chunk ``index`` of ``fqn`` from the base, as stored, to check it (:meth:`sound`)
        before it is taken; a future of (its bytes, where they are), or of None if it is missing."""
        entry = self.metadata.tensors[fqn]
        key = f"{entry.path}/{zarr_json.chunk_key(index)}"
        found = self.source.locator.locate(key)
        if found is None or found.inline is not None:
            return _Reading()
        length = found.length
        if length is None:  # a plain base's chunk file: its size is what the file holds (checked below)
            try:
                length = os.path.getsize(os.path.join(_path(self.choice.location), found.file))
            except OSError:
                return _Reading()
        return _Reading(self.source.fetcher.fetch(found.file, found.offset, found.offset + length), found)

    def sound(self, fqn: str, entry: TensorEntry, index: tuple[int, ...], reading: Any, digest: bytes) -> bool:
        """Whether the base's chunk that :meth:`read` started still holds what the base wrote: False when it
        is missing, truncated, replaced or any byte of it changed (its size, its shard index, the crc32c
        of every inner chunk, then the content hash ``digest`` of its stored bytes: a chunk replaced whole
        by another intact one has every crc32c right), so it must not be taken."""
        options = self.metadata.array_options
        fmt = shards.value_format(entry, options)
        what = f"tensor {fqn!r} of {self.choice.url}"
        try:
            found = reading.result()
            if found is None:
                return False
            data, _ = found
            if options.compression is not None:
                compressed.decode(fmt, options.compression, data, dtypes.from_zarr(entry.dtype).numpy, what)
            else:
                shards.check_stored_codec(fmt, index, data, what)
        except (ValueError, ChecksumError):  # missing, cut or changed in the base: damaged
            return False
        return content_hashes.stored(data) == digest

    def take(self, fqn: str, entry: TensorEntry, index: tuple[int, ...], reading: Any) -> Ref | bool | None:
        """Make chunk ``index`` of ``entry`` part of the new checkpoint: where it is stored (packed: the
        base's data file, linked into the new checkpoint), True (plain: its file linked), or None when it
        must be written instead (the filesystem cannot link it)."""
        data, where = reading.result()
        if self.choice.mode == PACKED:
            if not self._link(where.file):
                return None
            return Ref(where.file, where.offset, where.length if where.length is not None else len(data))
        return True if self._link(f"{entry.path}/{zarr_json.chunk_key(index)}") else None

    def _link(self, key: str) -> bool:
        """Hard-link the base's file ``key`` into the new checkpoint under the same name (once); False where
        the filesystem cannot."""
        known = self._linked.get(key)
        if known is not None:
            return known
        source = os.path.join(_path(self.choice.location), key)
        dest = os.path.join(_path(self.into.location), key)
        try:
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            os.link(source, dest)
            ok = True
        except FileExistsError:  # another rank linked it first (packed data files are shared)
            ok = os.path.samefile(source, dest)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise StorageError(f"linking {key} of the base {self.choice.url} into {self.into.url} "
                                   f"failed: {e.strerror}") from None
            ok = False  # another filesystem, or one without (more) hard links: write it
        self._linked[key] = ok
        return ok

    def linked_files(self) -> list[FileRef]:
        """The base's data files linked into the new checkpoint (packed), with their sizes."""
        return [FileRef(k, self._sizes[k]) for k, ok in self._linked.items() if ok and k in self._sizes]


@dataclass(frozen=True)
class _Digests:
    """The base's content hashes of one array's chunks, looked up by flat index (tables loaded as needed)."""

    base: BaseChunks
    entry: TensorEntry

    def get(self, flat: int) -> bytes | None:
        return self.base._lookup(self.entry, flat)


class _Reading:
    """A fetch of a base's chunk and where it is: its result is (bytes, where), or None if it is missing."""

    def __init__(self, fut: Any = None, where: Any = None):
        self.fut, self.where = fut, where

    def result(self) -> Any:
        if self.fut is None:
            return None
        try:
            return self.fut.result(), self.where
        except ValueError as e:
            if str(e).startswith("NOT_FOUND"):
                return None
            raise


def _path(location: Location) -> str:
    return str(location.spec.get("path", "")).rstrip("/")


def reuse_outcome(choice: BaseChoice | None, tensors: Mapping[str, TensorEntry],
                  reused: Mapping[str, np.ndarray], blob_bytes: int) -> Reuse | None:
    """Coordinator, at commit: the document's ``reuse`` record; ``reused[fqn]`` marks, in row-major grid order,
    the chunks the ranks took from the base."""
    if choice is None:
        return None
    reused_bytes = reused_chunks = 0
    for fqn, entry in tensors.items():
        flat = np.flatnonzero(reused[fqn])
        if not len(flat):
            continue
        grid, itemsize = entry.grid, dtypes.from_zarr(entry.dtype).itemsize
        for i in flat.tolist():
            index = tuple(int(n) for n in np.unravel_index(i, grid.grid_shape)) if entry.shape else ()
            reused_bytes += math.prod(s.stop - s.start for s in grid.chunk_region(index)) * itemsize
        reused_chunks += len(flat)
    written = sum(e.nbytes for e in tensors.values()) - reused_bytes + blob_bytes
    return Reuse(choice.url, choice.save_id, reused_chunks, reused_bytes, written, choice.note)
