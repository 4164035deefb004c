"""What :func:`tsckpt.verify` found: one report per tensor, stored value and the files beside them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class EntryReport:
    """What was checked for one tensor or stored value, and what is wrong with it."""

    key: str
    path: str
    nbytes: int
    chunks: int
    problems: tuple[str, ...] = ()
    #: Chunks compared with the crc32c the save recorded (0 when it recorded none).
    checksummed: int = 0
    #: The file or object each problem is about, in the order of :attr:`problems` (None: no one file, as for a
    #: ``zarr.json`` that disagrees with the metadata). Reports group damage by it.
    problem_files: tuple[str | None, ...] = ()
    #: The files or objects holding the entry's chunks (a plain layout's chunk files; a packed one's data files),
    #: so that a damaged file can say how many entries it holds.
    stored_in: tuple[str, ...] = ()
    #: "tensor", "value" (a stored non-tensor value's blob) or "files" (:attr:`VerifyReport.files`).
    kind: str = "tensor"

    @property
    def ok(self) -> bool:
        return not self.problems

    def file_of(self, n: int) -> str | None:
        """The file problem ``n`` is about, if one."""
        return self.problem_files[n] if n < len(self.problem_files) else None

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "path": self.path, "nbytes": self.nbytes, "chunks": self.chunks,
                "checksummed": self.checksummed, "problems": list(self.problems),
                "problem_files": [self.file_of(n) for n in range(len(self.problems))],
                "stored_in": list(self.stored_in), "kind": self.kind}


@dataclass(frozen=True)
class VerifyReport:
    """The result of :func:`verify` for a whole checkpoint."""

    location: str
    entries: tuple[EntryReport, ...] = field(default_factory=tuple)
    #: The data files, chunk tables and index beside the arrays.
    files: EntryReport | None = None

    @property
    def ok(self) -> bool:
        return all(e.ok for e in self.entries) and (self.files is None or self.files.ok)

    @property
    def failed(self) -> tuple[EntryReport, ...]:
        """What is damaged: arrays and values, then the files beside them."""
        found = tuple(e for e in self.entries if not e.ok)
        return found + ((self.files,) if self.files is not None and not self.files.ok else ())

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def chunks(self) -> int:
        return sum(e.chunks for e in self.entries)

    @property
    def checksummed(self) -> int:
        """Tensor chunks whose data was compared with a recorded crc32c."""
        return sum(e.checksummed for e in self.entries)

    def to_dict(self) -> dict[str, Any]:
        return {"location": self.location, "ok": self.ok, "entries": [e.to_dict() for e in self.entries],
                "files": self.files.to_dict() if self.files is not None else None}
