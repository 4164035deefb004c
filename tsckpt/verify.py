"""Check a checkpoint end to end without loading it into a model.

``verify(path)`` reads the committed metadata, then for every tensor and
stored value checks that:

* the array's ``zarr.json`` exists and agrees with the metadata (shape, data
  type, chunk grid, codecs);
* the regions the ranks wrote cover the tensor exactly once;
* every chunk file of the regular grid exists;
* every chunk decodes and passes its crc32c checksum (reading it through
  TensorStore with missing chunks treated as errors, never as fill values).

Problems are collected per entry instead of stopping at the first, so one run
tells which tensors and which chunks are damaged. Torch-free.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import tensorstore as ts

from . import arrays, grid, hierarchy
from .errors import PlanError
from .kvstore import DEFAULT_IO_CONCURRENCY, Location, make_context, open_kvstore, parse_location, read_json
from .metadata import CheckpointMetadata, TensorEntry

#: Bytes of chunk reads kept in flight at once.
_IN_FLIGHT_BYTES = 256 << 20
#: Above this many bytes the progress bar is shown when stderr is a terminal.
PROGRESS_BYTES = 1 << 30


@dataclass(frozen=True)
class EntryReport:
    """What was checked for one tensor or stored value, and what is wrong with it."""

    key: str
    path: str
    nbytes: int
    chunks: int
    problems: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "path": self.path, "nbytes": self.nbytes, "chunks": self.chunks,
                "problems": list(self.problems)}


@dataclass(frozen=True)
class VerifyReport:
    """The result of :func:`verify` for a whole checkpoint."""

    location: str
    entries: tuple[EntryReport, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return all(e.ok for e in self.entries)

    @property
    def failed(self) -> tuple[EntryReport, ...]:
        return tuple(e for e in self.entries if not e.ok)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def chunks(self) -> int:
        return sum(e.chunks for e in self.entries)

    def to_dict(self) -> dict[str, Any]:
        return {"location": self.location, "ok": self.ok, "entries": [e.to_dict() for e in self.entries]}


@dataclass(frozen=True)
class _Target:
    """One array to check: a tensor, or the uint8 blob of a stored value."""

    key: str
    path: str
    entry: TensorEntry | None  # None for a blob


def _grid(shape: Sequence[int], chunk: Sequence[int]) -> Iterator[tuple[int, ...]]:
    if math.prod(shape) == 0:
        return iter(())
    return itertools.product(*(range(-(-n // c)) for n, c in zip(shape, chunk)))


def _disagreements(e: TensorEntry, doc: Mapping[str, Any]) -> list[str]:
    """How ``doc`` differs from the ``zarr.json`` the metadata implies for ``e``.

    Codecs depend only on the writer's checksum and compression options, and
    the chunk-key separator on the tsckpt version (before "." it was "/"), so
    any combination tsckpt writes is accepted there.
    """
    want = arrays.array_metadata(e.shape, e.dtype, e.chunk_shape, e.inner_chunk_shape)
    diff = [f"{k}: metadata says {want[k]!r}, zarr.json says {doc.get(k)!r}"
            for k in ("shape", "data_type", "chunk_grid") if want[k] != doc.get(k)]
    chains = [arrays.array_metadata(e.shape, e.dtype, e.chunk_shape, e.inner_chunk_shape,
                                    checksums=c, compression=z)["codecs"]
              for c in (True, False) for z in (None, *arrays.COMPRESSORS)]
    if doc.get("codecs") not in chains:
        diff.append(f"codecs: zarr.json says {doc.get('codecs')!r}, not a chain tsckpt writes for this tensor")
    encoding = doc.get("chunk_key_encoding")
    if not isinstance(encoding, dict) or encoding.get("name") != "default" \
            or arrays.chunk_key_separator(doc) not in (".", "/"):
        diff.append(f"chunk_key_encoding: zarr.json says {encoding!r}, expected Zarr's default with '.' or '/'")
    return diff


class _Checker:
    def __init__(self, location: Location, context: ts.Context, progress: Any):
        self.location = location
        self.context = context
        self.kv = open_kvstore(location, context)
        self.progress = progress

    def run(self, target: _Target) -> EntryReport:
        problems: list[str] = []
        doc = self._zarr_json(target, problems)
        if doc is None:
            return EntryReport(target.key, target.path, 0, 0, tuple(problems))
        shape = [int(n) for n in doc["shape"]]
        chunk = [int(c) for c in doc["chunk_grid"]["configuration"]["chunk_shape"]]
        nbytes = math.prod(shape) * ts.dtype(doc["data_type"]).numpy_dtype.itemsize
        if target.entry is not None and target.entry.writes:
            try:
                grid.check_tiling(target.key, shape, [(w.offsets, w.sizes) for w in target.entry.writes])
            except PlanError as e:
                problems.append(f"written regions: {e}")
        indices = list(_grid(shape, chunk))
        sep = arrays.chunk_key_separator(doc)
        problems += self._missing_files(target.path, indices, sep)
        problems += self._read_chunks(target.path, shape, chunk, indices, nbytes, sep)
        return EntryReport(target.key, target.path, nbytes, len(indices), tuple(problems))

    def _zarr_json(self, target: _Target, problems: list[str]) -> dict[str, Any] | None:
        where = f"{target.path}/{hierarchy.ROOT}"
        try:
            doc = read_json(self.kv, where)
        except (ValueError, RecursionError) as e:
            problems.append(f"{where} is not valid JSON: {e}")
            return None
        if not isinstance(doc, dict) or doc.get("node_type") != "array":
            problems.append(f"{where} is missing or is not a Zarr array")
            return None
        if target.entry is not None:
            diff = _disagreements(target.entry, doc)
            if diff:
                problems.append(f"{where} disagrees with the checkpoint metadata ({'; '.join(diff)})")
                return None
        elif doc.get("data_type") != "uint8" or not isinstance(doc.get("shape"), list) or len(doc["shape"]) != 1:
            problems.append(f"{where} is not a 1-d uint8 array as a stored value must be")
            return None
        try:
            ts.dtype(doc["data_type"])
            if len(doc["chunk_grid"]["configuration"]["chunk_shape"]) != len(doc["shape"]):
                raise ValueError("chunk_shape rank differs from shape")
        except (KeyError, TypeError, ValueError) as e:
            problems.append(f"{where} is not a usable array description: {e}")
            return None
        return doc

    def _missing_files(self, path: str, indices: list[tuple[int, ...]], sep: str) -> list[str]:
        prefix = f"{path}/c"
        present = {k.decode() if isinstance(k, bytes) else k
                   for k in self.kv.list(ts.KvStore.KeyRange(prefix, prefix + "\xff")).result()}
        keys = [arrays.chunk_key(i, sep) for i in indices]
        return [f"chunk {key}: file {path}/{key} is missing" for key in keys if f"{path}/{key}" not in present]

    def _read_chunks(self, path: str, shape: list[int], chunk: list[int],
                     indices: list[tuple[int, ...]], nbytes: int, sep: str) -> list[str]:
        if not indices:
            return []
        try:
            arr = ts.open({"driver": "zarr3", "kvstore": self.location.child(path),
                           "fill_missing_data_reads": False}, context=self.context, read=True).result()
        except Exception as e:  # TensorStore reports every failure as ValueError or its own types
            return [f"cannot open the array: {e}"]
        problems: list[str] = []
        chunk_bytes = max(nbytes // len(indices), 1)
        batch = max(1, _IN_FLIGHT_BYTES // chunk_bytes)
        for start in range(0, len(indices), batch):
            part = indices[start:start + batch]
            futures = []
            for idx in part:
                region = tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(idx, chunk, shape))
                futures.append((idx, arr[region].read() if region else arr.read()))
            for idx, fut in futures:
                try:
                    fut.result()
                except Exception as e:
                    problems.append(f"chunk {arrays.chunk_key(idx, sep)}: {e}")
            if self.progress is not None:
                self.progress(chunk_bytes * len(part))
        return problems


def _targets(md: CheckpointMetadata) -> list[_Target]:
    out = [_Target(key, e.path, e) for key, e in md.tensors.items()]
    out += [_Target(key, o.path, None) for key, o in md.objects.items() if o.path is not None]
    return out


def verify(
    location: str | os.PathLike[str] | Mapping[str, Any],
    *,
    progress: bool | None = None,
    io_concurrency: int = DEFAULT_IO_CONCURRENCY,
) -> VerifyReport:
    """Read and check every chunk of the checkpoint at ``location``.

    Args:
        location: checkpoint directory, ``file://`` URL or kvstore spec.
        progress: show a progress bar on stderr; by default only for
            checkpoints above :data:`PROGRESS_BYTES` when stderr is a terminal.
        io_concurrency: TensorStore file I/O concurrency.

    Returns:
        A :class:`VerifyReport`; ``report.ok`` is False if anything is damaged.

    Raises:
        TsckptError: the checkpoint is missing, incomplete or its metadata is
            unreadable, so nothing else can be checked.
    """
    loc = parse_location(location)
    context = make_context(io_concurrency)
    md = hierarchy.read_metadata(open_kvstore(loc, context), loc.url)
    targets = _targets(md)
    total = sum(t.nbytes for t in md.tensors.values())
    show = progress if progress is not None else (total >= PROGRESS_BYTES and sys.stderr.isatty())
    if not show:
        return VerifyReport(loc.url, tuple(_Checker(loc, context, None).run(t) for t in targets))
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    with Progress(TextColumn("verify"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("verify", total=total)
        checker = _Checker(loc, context, lambda n: bar.advance(task, n))
        return VerifyReport(loc.url, tuple(checker.run(t) for t in targets))

