"""Data files: where a checkpoint's bytes are beyond its Zarr keys, as the metadata document records them
(``docs/format.md``, section 1): each rank's files and chunk table, and the packed layout's index."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import MetadataError
from .fields import MAX_TENSOR_BYTES, get_field
from .names import check_relative_path


@dataclass(frozen=True)
class FileRef:
    """A file (or object) readers find through the root document: its path and size, and on object stores the
    generation it was written as (its ETag on S3), so that a read of an object replaced since is refused."""

    path: str
    size: int
    generation: str | None = None

    def to_list(self) -> list[Any]:
        return [self.path, self.size] + ([self.generation] if self.generation is not None else [])

    @classmethod
    def from_list(cls, value: Any, what: str) -> FileRef:
        if (not isinstance(value, list) or len(value) not in (2, 3) or not isinstance(value[0], str)
                or not isinstance(value[1], int) or isinstance(value[1], bool) or not 0 <= value[1] <= MAX_TENSOR_BYTES
                or (len(value) == 3 and not isinstance(value[2], str))):
            raise MetadataError(f"{what}: expected [path, size] or [path, size, generation], got {value!r}")
        return cls(check_relative_path(value[0], what=what), value[1], value[2] if len(value) == 3 else None)


@dataclass(frozen=True)
class Span:
    """``length`` bytes at ``offset`` of file ``path`` (a rank's chunk table, the index's root node)."""

    path: str
    offset: int
    length: int

    def to_list(self) -> list[Any]:
        return [self.path, self.offset, self.length]

    @classmethod
    def from_list(cls, value: Any, what: str) -> Span:
        if (not isinstance(value, list) or len(value) != 3 or not isinstance(value[0], str)
                or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_TENSOR_BYTES
                           for v in value[1:]) or value[1] + value[2] > MAX_TENSOR_BYTES):
            raise MetadataError(f"{what}: expected [path, offset, length] within a file, got {value!r}")
        return cls(check_relative_path(value[0], what=what), value[1], value[2])


@dataclass(frozen=True)
class RankFiles:
    """What one rank of a save wrote besides chunk keys: its data files (packed layout) and its chunk table
    (:mod:`tsckpt.format.chunk_table`; None in a plain save without content hashes)."""

    files: tuple[FileRef, ...] = ()
    table: Span | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"files": [f.to_list() for f in self.files],
                "table": self.table.to_list() if self.table is not None else None}

    @classmethod
    def from_dict(cls, d: Any, what: str) -> RankFiles:
        files = tuple(FileRef.from_list(f, f"{what}: files[{i}]")
                      for i, f in enumerate(get_field(d, "files", what, list)))
        table = d.get("table")
        return cls(files, Span.from_list(table, f"{what}: table") if table is not None else None)


@dataclass(frozen=True)
class DataFiles:
    """Where a checkpoint's bytes are, beyond its Zarr keys. ``index``: the packed layout's B+tree root node, the
    end of the node file (None in the plain layout); ``ranks``: what each rank wrote, in rank order."""

    index: Span | None
    ranks: tuple[RankFiles, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index.to_list() if self.index is not None else None,
                "ranks": [r.to_dict() for r in self.ranks]}

    @classmethod
    def from_dict(cls, d: Any, what: str = "data_files") -> DataFiles:
        index = d.get("index") if isinstance(d, Mapping) else None
        return cls(Span.from_list(index, f"{what}: index") if index is not None else None,
                   tuple(RankFiles.from_dict(r, f"{what}: ranks[{i}]")
                         for i, r in enumerate(get_field(d, "ranks", what, list))))

    @property
    def files(self) -> tuple[FileRef, ...]:
        """Every data file, the index last."""
        index = (FileRef(self.index.path, self.index.offset + self.index.length),) if self.index is not None else ()
        return tuple(f for r in self.ranks for f in r.files) + index
