"""What an incremental save took from its base: the root document's ``reuse`` record (``docs/format.md``,
section 8), informative only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import MetadataError
from .fields import get_field, optional_field


@dataclass(frozen=True)
class Reuse:
    """The base a save compared against, and its tensor bytes written and reused.

    Attributes:
        base: the base checkpoint's location, as text (a path or URL).
        base_save_id: the ``extra.save_id`` of the base when it was read.
        chunks_reused: outer chunks linked from the base instead of written.
        bytes_reused: tensor bytes of those chunks.
        bytes_written: tensor and value-blob bytes this save wrote.
        note: why nothing could be reused, when that was known before writing
            (say, the base is on an object store, or in another layout); else None.
    """

    base: str
    base_save_id: str | None
    chunks_reused: int
    bytes_reused: int
    bytes_written: int
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"base": self.base, "base_save_id": self.base_save_id, "chunks_reused": self.chunks_reused,
                "bytes_reused": self.bytes_reused, "bytes_written": self.bytes_written, "note": self.note}

    @classmethod
    def from_dict(cls, d: Any, what: str = "reuse") -> Reuse:
        counts = {}
        for name in ("chunks_reused", "bytes_reused", "bytes_written"):
            value = get_field(d, name, what, int)
            if value < 0:
                raise MetadataError(f"{what}: {name} must be >= 0, not {value}")
            counts[name] = value
        return cls(base=get_field(d, "base", what, str),
                   base_save_id=optional_field(d, "base_save_id", what, str),
                   note=optional_field(d, "note", what, str), **counts)
