"""The files beside a packed checkpoint's arrays checked whole, for :func:`tsckpt.verify`: each data file's size,
each rank's chunk table and the index."""

from __future__ import annotations

import os
from typing import Any

from ..errors import TsckptError
from ..format.ocdbt import MANIFEST_KEY, Manifest
from ..storage.chunk_source import ChunkSource
from .verify_report import EntryReport


def files_report(source: ChunkSource) -> EntryReport | None:
    """The files beside the arrays, checked whole: each data file's size, each rank's chunk
    table and the packed layout's index (nodes and manifest, by their crc32c, and where it says each value is)."""
    md = source.metadata
    files = md.data_files
    if files is None:
        return None
    problems: list[str] = []
    about: list[str | None] = []

    def found(problem: str, file: str | None) -> None:
        problems.append(problem)
        about.append(file)

    kv = source.store.kvstore
    local = source.store.location.driver == "file"
    for f in files.files:
        if local:  # the size itself, where one can be had: what a truncation changes
            full = os.path.join(str(source.store.location.spec.get("path", "")), f.path)
            if not os.path.exists(full):
                found(f"{f.path} is missing", f.path)
            elif os.path.getsize(full) != f.size:
                found(f"{f.path} is {os.path.getsize(full)} bytes, not the {f.size} written (truncated or replaced)",
                      f.path)
            continue
        try:
            result = kv.read(f.path, byte_range=slice(f.size, f.size)).result() if f.size else kv.read(f.path).result()
            missing = result.state != "value"
        except ValueError as e:
            # A read at the recorded end fails when the file or object is shorter.
            found(f"{f.path} is shorter than the {f.size} bytes written: {e}", f.path)
            continue
        if missing:
            found(f"{f.path} is missing", f.path)
    for rank, record in enumerate(files.ranks):
        if record.table is None:
            continue
        try:
            source.tables.everything(rank)
        except (ValueError, TsckptError) as e:
            found(str(e), record.table.path)
    index_file = files.index.path if files.index is not None else None
    if files.index is not None:
        try:
            index = source.locator.everything()
            Manifest.decode(kv.read(MANIFEST_KEY).result().value, MANIFEST_KEY)
            # What TensorStore and zarr-python find through the index must be what tsckpt finds in the tables.
            source.locator.prefetch(index)
            odd = next((k for k, v in index.items() if v.inline is None and _located(source, k) not in (v, None)),
                       None)
            if odd is not None:
                found(f"the index and the chunk tables disagree on where {odd} is stored", index_file)
        except (ValueError, TsckptError) as e:
            found(str(e), index_file)
    return EntryReport("(data files)", "d/", sum(f.size for f in files.files), 0, tuple(problems),
                       problem_files=tuple(about), kind="files")


def _located(source: ChunkSource, key: str) -> Any:
    """Where the chunk tables say ``key`` is; None where its table cannot be read (reported as the table's damage)."""
    try:
        return source.locator.locate(key)
    except TsckptError:
        return None
