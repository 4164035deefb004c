"""Check a checkpoint end to end without loading it: ``tsckpt.verify``.

For every tensor and stored value: its ``zarr.json`` agrees with the metadata, and every chunk exists, decodes
and matches its crc32c and recorded content hash; then the files beside the arrays are checked whole. Problems
are collected per entry, not stopped at. Torch-free.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorstore as ts

from ..commit import protocol as commit
from ..errors import ChecksumError, MetadataError, TsckptError
from ..format import compressed, content_hashes, dtypes, shards, zarr_json
from ..format.grid import ChunkGrid
from ..format.metadata import TensorEntry
from ..format.ocdbt import MANIFEST_KEY, Manifest
from ..progress import PROGRESS_BYTES, progress_bar, wanted
from ..storage.chunk_source import ChunkSource
from ..storage.context import DEFAULT_IO_CONCURRENCY
from ..storage.fetchers import LocalFiles
from ..storage.kvio import read_json
from ..storage.location import LocationLike
from .verify_report import EntryReport, VerifyReport

#: Bytes of chunk reads kept in flight at once.
_IN_FLIGHT_BYTES = 256 << 20
#: An array's ``zarr.json`` is a few hundred bytes; anything this large is not one tsckpt wrote.
_MAX_NODE_BYTES = 1 << 20
__all__ = ["EntryReport", "PROGRESS_BYTES", "VerifyReport", "verify"]


@dataclass(frozen=True)
class _Target:
    """One array to check: a tensor, or the uint8 blob of a stored value."""
    key: str
    path: str
    entry: TensorEntry | None  # None for a blob


class _Checker:
    def __init__(self, source: ChunkSource, advance: Callable[[int], None]):
        self.source, self.store, self.advance = source, source.store, advance

    def run(self, target: _Target) -> EntryReport:
        try:
            report = self._check(target)
        except (ChecksumError, MetadataError) as e:  # damage below the arrays (a packed checkpoint's index)
            index = self.source.metadata.data_files.index if self.source.metadata.data_files else None
            report = EntryReport(target.key, target.path, 0, 0, (str(e),),
                                 problem_files=(index.path if index is not None else None,))
        return report if target.entry is not None else dataclasses.replace(report, kind="value")

    def _check(self, target: _Target) -> EntryReport:
        kv = self.store.node_kvstore(target.path)
        doc = self._zarr_json(kv, target)
        if isinstance(doc, str):
            return EntryReport(target.key, target.path, 0, 0, (doc,))
        chunks = ChunkGrid(tuple(doc["shape"]), tuple(doc["chunk_grid"]["configuration"]["chunk_shape"]))
        nbytes = math.prod(chunks.shape) * dtypes.from_zarr(doc["data_type"]).itemsize
        indices = list(chunks.indices())
        sep = zarr_json.chunk_key_separator(doc)
        listed = {k.decode() if isinstance(k, bytes) else k for k in kv.list(ts.KvStore.KeyRange("c", "c\xff")).result()}
        missing = sorted({name for name in (zarr_json.chunk_key(i, sep) for i in indices) if name not in listed})
        found = [(f"chunk {name}: {target.path}/{name} is missing", self._writer_file(target, name)) for name in missing]
        # A missing chunk is reported once, not again as the read that fails on it.
        present = [i for i in indices if zarr_json.chunk_key(i, sep) not in missing]
        stored_in: set[str] = set()
        checksummed = 0
        if present and target.entry is not None:
            read_problems, checksummed = self._read_stored(target, present, nbytes, sep, stored_in)
            found += read_problems
        elif present:
            found += self._read_blob(target, nbytes, sep, stored_in)
        return EntryReport(target.key, target.path, nbytes, len(indices), tuple(p for p, _ in found), checksummed,
                           tuple(f for _, f in found), tuple(sorted(stored_in)))

    def _writer_file(self, target: _Target, key: str) -> str | None:
        """Where chunk ``key`` is, when its writer's chunk table cannot say: that rank's data file (whose end holds
        the table), or in the plain layout the chunk's own file."""
        md = self.source.metadata
        if md.layout != "packed":
            return f"{target.path}/{key}"
        record = md.writer_files(target.key, tuple(int(p) for p in key[2:].split(".")) if key != "c" else ())
        if record is None:
            return None
        return record.table.path if record.table is not None else (record.files[-1].path if record.files else None)

    def _zarr_json(self, kv: ts.KvStore, target: _Target) -> dict[str, Any] | str:
        """The array's ``zarr.json``, equal to the one tsckpt wrote (``attributes`` aside), or what is wrong."""
        where = f"{target.path}/{commit.ROOT}"
        try:
            doc = read_json(kv, commit.ROOT, where=f"{self.store.url}/{target.path}", max_bytes=_MAX_NODE_BYTES)
        except (ValueError, RecursionError, MetadataError) as e:
            return f"{where} is not valid JSON: {e}"
        if not isinstance(doc, dict) or doc.get("node_type") != "array":
            return f"{where} is missing or is not a Zarr array"
        if target.entry is not None:
            want = target.entry.zarr_json(self.source.metadata.array_options)
        else:  # a blob, of the length its document declares
            shape = doc.get("shape")
            if not (isinstance(shape, list) and len(shape) == 1 and isinstance(shape[0], int)
                    and not isinstance(shape[0], bool) and 0 <= shape[0] < 2**63):
                return f"{where} is not a 1-d uint8 array as a stored value must be"
            want = zarr_json.blob_metadata(shape[0])
        diff = [f"{k}: metadata says {want.get(k)!r}, zarr.json says {doc.get(k)!r}"
                for k in sorted((want.keys() | doc.keys()) - {"attributes"}) if want.get(k) != doc.get(k)]
        return f"{where} disagrees with the checkpoint metadata ({'; '.join(diff)})" if diff else doc

    def _read_stored(self, target: _Target, indices: list[tuple[int, ...]], nbytes: int,
                     sep: str, stored_in: set[str]) -> tuple[list[tuple[str, str | None]], int]:
        """Every chunk read whole and checked as stored: its size and index, the crc32c of each inner chunk (or,
        compressed, each decoded), and the content hash its rank recorded (a chunk replaced whole by another
        intact one has every crc32c right)."""
        entry = target.entry
        assert entry is not None
        source, md = self.source, self.source.metadata
        options = md.array_options
        fmt = shards.value_format(entry, options)
        what = f"tensor {target.key!r}"
        problems: list[tuple[str, str | None]] = []
        try:
            hashes = source.digests(entry)
        except TsckptError as e:
            ranks = set(entry.writer_ranks(md.world_size, what).tolist()) if entry.writers is not None else set()
            tables = {md.data_files.ranks[r].table for r in ranks} if md.data_files is not None else set()
            table = tables.pop() if len(tables) == 1 else None
            problems.append((str(e), table.path if table is not None else None))
            hashes = {}
        checked, chunk_bytes = 0, max(nbytes // len(indices), 1)
        step = max(1, _IN_FLIGHT_BYTES // chunk_bytes)
        for start in range(0, len(indices), step):
            part = [(idx, zarr_json.chunk_key(idx, sep)) for idx in indices[start:start + step]]
            source.locator.prefetch(f"{entry.path}/{name}" for _, name in part)
            batch = source.batch()
            reads = [(idx, name, *self._start_read(target, name, fmt, batch, stored_in)) for idx, name in part]
            batch.run()
            for idx, name, got, file in reads:
                try:
                    if isinstance(got, Exception):
                        raise got
                    data = (got.bytes if not hasattr(got, "inline") else
                            np.frombuffer(source.locator.kvstore.read(got.file).result().value, np.uint8))
                    if options.compression is not None:
                        compressed.decode(fmt, options.compression, data, dtypes.from_zarr(entry.dtype).numpy,
                                          f"{what}: chunk {list(idx)}")
                    else:
                        shards.check_stored_codec(fmt, idx, data, what)
                    checked += md.codec_checksums
                except Exception as e:  # every way a chunk can fail is reported, and the others still checked
                    problems.append((f"chunk {name}: {e}", file))
                    continue
                recorded = hashes.get(entry.grid.flat_index(idx))
                if recorded is not None and content_hashes.stored(data) != recorded:
                    problems.append((f"chunk {name}: its stored bytes do not have the content hash recorded when "
                                     f"it was saved (the chunk was replaced by another)", file))
            self.advance(chunk_bytes * len(part))
        return problems, checked

    def _start_read(self, target: _Target, name: str, fmt: shards.ShardFormat, batch: Any,
                    stored_in: set[str]) -> tuple[Any, str | None]:
        """Chunk ``name`` of ``target``, added to ``batch``: (its read, where the tables say it is (a file read
        whole) or why it cannot be read; the file a problem with it is about)."""
        key = f"{target.path}/{name}"
        try:
            found = self.source.locator.locate(key)
        except TsckptError as e:  # its writer's chunk table is damaged or unreadable
            file = self._writer_file(target, name)
            stored_in.update(f for f in (file,) if f is not None)
            return ValueError(str(e)), file
        if found is None:
            return ValueError(f"{key} is missing (its writer's chunk table has no row for it)"), \
                self._writer_file(target, name)
        stored_in.add(found.file)
        if found.length is None and self.source.metadata.array_options.compression is not None:
            return found, found.file  # a plain chunk file of unknown size: read whole
        if found.length is None and isinstance(self.source.fetcher, LocalFiles):
            self.source.fetcher.expect(found.file, fmt.nbytes)
        length = found.length if found.length is not None else fmt.nbytes
        return batch.want(found.file, found.offset, found.offset + length), found.file

    def _read_blob(self, target: _Target, nbytes: int, sep: str, stored_in: set[str]) -> list[tuple[str, str | None]]:
        """A value blob, read whole through TensorStore, whose crc32c codec checks it."""
        name = zarr_json.chunk_key((0,), sep)
        try:
            found = self.source.locator.locate(f"{target.path}/{name}")
            file = found.file if found is not None and found.file else self._writer_file(target, name)
        except TsckptError:
            file = self._writer_file(target, name)
        stored_in.update(f for f in (file,) if f is not None)
        try:
            blob = self.store.open_blob(target.path).result()
        except Exception as e:  # TensorStore reports every failure as ValueError or its own types
            return [(f"cannot open the array: {e}", file)]
        try:
            blob.read().result()
        except Exception as e:
            return [(f"chunk {name}: {e}", file)]
        finally:
            self.advance(nbytes)
        return []


def _files_report(source: ChunkSource) -> EntryReport | None:
    """The files beside the arrays, checked whole: each data file's size, each rank's chunk table and the packed
    layout's index (nodes and manifest, by their crc32c, and where it says each value is)."""
    files = source.metadata.data_files
    if files is None:
        return None
    found: list[tuple[str, str | None]] = []
    kv, location = source.store.kvstore, source.store.location
    for f in files.files:
        if location.driver == "file":  # the size itself, where one can be had: what a truncation changes
            full = os.path.join(str(location.spec.get("path", "")), f.path)
            size = os.path.getsize(full) if os.path.exists(full) else None
            if size != f.size:
                found.append((f"{f.path} is missing" if size is None else
                              f"{f.path} is {size} bytes, not the {f.size} written (truncated or replaced)", f.path))
            continue
        try:
            if (kv.read(f.path, byte_range=slice(f.size, f.size)) if f.size else kv.read(f.path)).result().state != "value":
                found.append((f"{f.path} is missing", f.path))
        except ValueError as e:  # a read at the recorded end fails when the file or object is shorter
            found.append((f"{f.path} is shorter than the {f.size} bytes written: {e}", f.path))
    for rank, record in enumerate(files.ranks):
        try:
            if record.table is not None:
                source.tables.everything(rank)
        except (ValueError, TsckptError) as e:
            found.append((str(e), record.table.path))
    if files.index is not None:
        try:
            index = source.locator.everything()
            Manifest.decode(kv.read(MANIFEST_KEY).result().value, MANIFEST_KEY)
            # What TensorStore and zarr-python find through the index must be what tsckpt finds in the tables.
            source.locator.prefetch(index)
            odd = next((k for k, v in index.items() if v.inline is None and _located(source, k) not in (v, None)),
                       None)
            if odd is not None:
                found.append((f"the index and the chunk tables disagree on where {odd} is stored", files.index.path))
        except (ValueError, TsckptError) as e:
            found.append((str(e), files.index.path))
    return EntryReport("(data files)", "d/", sum(f.size for f in files.files), 0, tuple(p for p, _ in found),
                       problem_files=tuple(f for _, f in found), kind="files")


def _located(source: ChunkSource, key: str) -> Any:
    """Where the chunk tables say ``key`` is; None where its table cannot be read (reported as the table's damage)."""
    try:
        return source.locator.locate(key)
    except TsckptError:
        return None


def verify(location: LocationLike, *, progress: bool | None = None,
           io_concurrency: int = DEFAULT_IO_CONCURRENCY) -> VerifyReport:
    """Read and check every chunk of the checkpoint at ``location``.

    Args:
        location: checkpoint directory, URL or kvstore spec.
        progress: show a progress bar on stderr; by default only for
            checkpoints above :data:`PROGRESS_BYTES` when stderr is a terminal.
        io_concurrency: TensorStore I/O concurrency.

    Returns:
        A :class:`VerifyReport`; ``report.ok`` is False if anything is damaged.

    Raises:
        TsckptError: the checkpoint is missing, incomplete or its metadata is
            unreadable, so nothing else can be checked.
    """
    store, md = commit.open_committed(location, io_concurrency=io_concurrency)
    source = ChunkSource.of(store, md)
    total = sum(t.nbytes for t in md.tensors.values())
    with progress_bar(wanted(progress, total), total, "verify", transient=True) as advance:
        checker = _Checker(source, advance)
        entries = tuple(checker.run(_Target(key, e.path, e)) for key, e in md.tensors.items())
        entries += tuple(checker.run(_Target(key, o.path, None)) for key, o in md.objects.items() if o.path is not None)
    return VerifyReport(store.url, entries, _files_report(source))
