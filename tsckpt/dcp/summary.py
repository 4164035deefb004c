"""What one rank of a save wrote, as the coordinator learns it: :class:`RankSummary` (contract step 4), in
columns, so that gathering every rank's costs bytes linear in chunks and nothing per Python object. Torch-free:
:class:`~tsckpt.conversion.builder.CheckpointBuilder` summarises its writes the same way."""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..format import object_values
from ..format.data_files import RankFiles
from ..format.ocdbt import Ref
from ..rank_writer import WrittenChunks as SavedChunks


@dataclass(frozen=True)
class RankSummary:
    """What one rank wrote, in columns: one row per outer chunk, numbered as the coordinator numbered tensors.

    ``file``/``offset``/``length``: where each chunk is stored in the packed layout (``file`` indexes ``files``:
    the rank's own data files and those of an incremental save's base); -1 in the plain layout. ``reused``: taken
    from the base. ``stored``: the rank's data files and digest table. ``objects``: each value's encoding (and
    its JSON value, or blob size and, packed, where it is stored). ``placements``: with DCP's own planner, whose
    plans carry none, the placement records of the tensors this rank describes.
    """

    rank: int
    save_id: str  # from the orders the rank wrote with
    tensor: np.ndarray | None  # int32; None while packed
    chunk: np.ndarray | None  # int64, flat index in the tensor's chunk grid; None while packed
    file: np.ndarray | None = None  # int32, into files; -1 for chunks that are keys of their own
    offset: np.ndarray | None = None  # int64
    length: np.ndarray | None = None  # int64
    reused: np.ndarray | None = None  # bool
    files: tuple[str, ...] = ()
    stored: RankFiles | None = None
    objects: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    placements: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    failure: Mapping[str, Any] | None = None  # why this rank could not write its part (a RankFailure's dict)
    #: The columns as gathered (those above are then None), decoded with every rank's at once by :func:`columns_of`.
    packed: PackedColumns | None = None

    def has(self, name: str) -> bool:
        if self.packed is not None:
            return any(n == name for n, _, _ in self.packed.layout)
        return getattr(self, name) is not None

    def decoded(self) -> RankSummary:
        if self.packed is None:
            return self
        columns = columns_of([self])
        return dataclasses.replace(self, packed=None, **{name: None if columns[name] is None else
                                                         full(columns[name], columns["rows"]).astype(dtype)
                                                         for name, dtype in _COLUMNS.items()})

    def __reduce__(self) -> tuple[Any, ...]:
        # Columns travel delta-coded (a regular layout's offsets and numbers are runs), a column of one value as
        # that value, the others in the narrowest integers that hold them, compressed.
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name not in _COLUMNS and f.name != "packed"}
        return (_unpacked, (fields, self.packed or self._pack()))

    def _pack(self) -> PackedColumns:
        layout, parts = [], []
        for name in _COLUMNS:
            column = getattr(self, name)
            if column is None:
                continue
            values = np.diff(column.astype(np.int64), prepend=0) if name in _DELTAS else column.astype(np.int64)
            if len(values) and (values == values[0]).all():
                layout.append((name, None, int(values[0])))
                continue
            narrow = _narrowest(values)
            layout.append((name, narrow.str, 0))
            parts.append(values.astype(narrow).tobytes())
        return PackedColumns(tuple(layout), len(self.tensor), zlib.compress(b"".join(parts), 1))

    def to_dict(self) -> dict[str, Any]:
        if self.packed is not None:
            return self.decoded().to_dict()

        def column(a: np.ndarray | None) -> list[Any] | None:
            return None if a is None else a.tolist()

        return {"rank": self.rank, "save_id": self.save_id, "tensor": self.tensor.tolist(),
                "chunk": self.chunk.tolist(), "file": column(self.file), "offset": column(self.offset),
                "length": column(self.length), "reused": column(self.reused), "files": list(self.files),
                "stored": None if self.stored is None else self.stored.to_dict(),
                "objects": dict(self.objects), "placements": dict(self.placements),
                "failure": None if self.failure is None else dict(self.failure)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RankSummary:
        def column(key: str, dtype: Any) -> np.ndarray | None:
            return None if d.get(key) is None else np.asarray(d[key], dtype)

        stored = d.get("stored")
        return cls(int(d["rank"]), d["save_id"], np.asarray(d["tensor"], np.int32), np.asarray(d["chunk"], np.int64),
                   column("file", np.int32), column("offset", np.int64), column("length", np.int64),
                   column("reused", bool), tuple(d.get("files") or ()),
                   None if stored is None else RankFiles.from_dict(stored, "rank summary"),
                   dict(d["objects"]), dict(d.get("placements") or {}), d.get("failure"))


#: The columns of a :class:`RankSummary`, with their dtypes; those in ``_DELTAS`` travel as differences.
_COLUMNS = {"tensor": np.int32, "chunk": np.int64, "file": np.int32, "offset": np.int64, "length": np.int64,
            "reused": bool}
_DELTAS = frozenset({"tensor", "chunk", "offset"})


def _narrowest(values: np.ndarray) -> np.dtype:
    for dtype in (np.int8, np.int16, np.int32):
        info = np.iinfo(dtype)
        if not len(values) or (values.min() >= info.min and values.max() <= info.max):
            return np.dtype(dtype)
    return np.dtype(np.int64)


def _unpacked(fields: dict[str, Any], packed: PackedColumns) -> RankSummary:
    return RankSummary(**fields, tensor=None, chunk=None, packed=packed)


@dataclass(frozen=True)
class PackedColumns:
    """A gathered summary's columns as they travelled: per column its name and either its dtype (values in
    ``data``, zlib) or None and the one value all its rows hold."""

    layout: tuple[tuple[str, str | None, int], ...]
    rows: int
    data: bytes


def expand(values: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Each of ``values`` repeated its number of ``rows``; several times faster than a repeat by counts when every
    rank that has rows has as many (the common case)."""
    some = rows > 0
    counts = rows[some]
    if len(counts) and (counts == counts[0]).all():
        return np.repeat(values[some], int(counts[0]))
    return np.repeat(values, rows)


@dataclass(frozen=True)
class PerRank:
    """A decoded column of one value per summary (0 for one of no rows); as a column of every row it would be
    hundreds of megabytes of new pages at 100,000 ranks, which merging reduces back to one value per rank."""

    values: np.ndarray


def full(column: np.ndarray | PerRank, rows: np.ndarray) -> np.ndarray:
    return expand(column.values, rows) if isinstance(column, PerRank) else column


def columns_of(summaries: Sequence[RankSummary],
               file_numbers: Sequence[np.ndarray] | None = None) -> dict[str, np.ndarray | PerRank | None]:
    """Every summary's columns, one after the other (None for a column some summary lacks; a :class:`PerRank`
    for one not delta-coded that no summary sent as an array), and ``"rows"``: each summary's number of rows.
    Decoded all at once, each in the narrowest type that holds what the ranks sent: a few passes over tens of
    millions of rows instead of a few per rank. ``file_numbers``: per summary, the number each of its files
    gets (-1 stays -1)."""
    rows = np.asarray([s.packed.rows if s.packed is not None else len(s.tensor) for s in summaries], np.int64)
    # A column that holds one value on a rank (most do, in a regular layout) costs that rank no array.
    constants = {name: np.zeros(len(summaries), np.int64) for name in _COLUMNS}
    arrays: dict[str, list[tuple[int, np.ndarray]]] = {name: [] for name in _COLUMNS}
    sent = dict.fromkeys(_COLUMNS, 0)
    counts = rows.tolist()
    for i, s in enumerate(summaries):
        packed = s.packed or s._pack()  # one made in this process decodes as one that travelled
        raw, at = zlib.decompress(packed.data), 0
        for name, dtype, constant in packed.layout:
            sent[name] += 1
            if not counts[i]:  # a rank without rows sends empty arrays: no part to place
                continue
            if dtype is None:
                if name == "file" and file_numbers is not None and constant >= 0:
                    constant = int(file_numbers[i][constant])
                constants[name][i] = constant
                continue
            values = np.frombuffer(raw, np.dtype(dtype), counts[i], at)
            at += values.nbytes
            if name == "file" and file_numbers is not None:
                values = np.append(file_numbers[i], -1)[values]  # -1 indexes the appended -1
            arrays[name].append((i, values))
    out: dict[str, np.ndarray | PerRank | None] = {"rows": rows}
    for name in _COLUMNS:
        if sent[name] < len(summaries):
            out[name] = None
        elif arrays[name] or name in _DELTAS:  # a delta-coded constant is a run, not one value
            out[name] = _joined(name, constants[name], arrays[name], rows)
        else:
            out[name] = PerRank(constants[name].astype(_decoded_type(name, constants[name], [])))
    return out


def _decoded_type(name: str, constants: np.ndarray, parts: Sequence[np.ndarray]) -> np.dtype:
    """The type column ``name`` is decoded to. Running sums are exact in a type that holds every value summed to
    (intermediate sums may wrap); other columns as wide as the widest a rank sent or the constants need."""
    if name == "reused":
        return np.dtype(bool)
    if name in _DELTAS:
        return np.dtype(_COLUMNS[name])
    return np.result_type(_narrowest(constants), *(p.dtype for p in parts))


def _joined(name: str, constants: np.ndarray, arrays: list[tuple[int, np.ndarray]], rows: np.ndarray) -> np.ndarray:
    """One column of every rank's rows: each rank's constant or its array of values (in ``_DELTAS``: of
    differences, summed here)."""
    dtype = _decoded_type(name, constants, [part for _, part in arrays])
    values = np.empty(int(rows.sum()), dtype)
    if not len(values):
        return values
    parts = dict(arrays)
    pieces = [parts[i] if i in parts else np.broadcast_to(constants[i:i + 1], (n,))
              for i, n in enumerate(rows.tolist()) if n]
    ends = np.cumsum(rows[rows > 0])
    # Whole ranks to a block of about _BLOCK rows: each block copied in one call, its running sums taken in cache.
    a = 0
    while a < len(pieces):
        lo = int(ends[a - 1]) if a else 0
        b = max(a + 1, int(np.searchsorted(ends, lo + _BLOCK, side="right")))
        block = values[lo:int(ends[b - 1])]
        np.concatenate(pieces[a:b], out=block, casting="unsafe")
        if name in _DELTAS:
            # Each rank's first difference less what the rank before summed to (wrapping as the running sum does).
            first = np.concatenate(([0], ends[a:b - 1] - lo))
            sums = np.add.reduceat(block, first, dtype=dtype)
            block[first[1:]] -= sums[:-1]
            np.cumsum(block, dtype=dtype, out=block)
        a = b
    return values


#: Rows decoded at once by :func:`_joined`: a block stays in cache for its running sums.
_BLOCK = 1 << 16


class SummaryBuilder:
    """Collects a rank's :class:`RankSummary` from what its ``RankWriter`` saved."""

    def __init__(self, rank: int, save_id: str):
        self.rank, self.save_id = rank, save_id
        self.tensor: list[int] = []
        self.chunk: list[int] = []
        self.file: list[int] = []
        self.offset: list[int] = []
        self.length: list[int] = []
        self.reused: list[bool] = []
        self.files: dict[str, int] = {}
        self.objects: dict[str, dict[str, Any]] = {}
        self.placements: dict[str, dict[str, Any]] = {}

    def _where(self, ref: Ref | None) -> tuple[int, int, int]:
        if ref is None:
            return -1, 0, 0
        return self.files.setdefault(ref.path, len(self.files)), ref.offset, ref.length

    def add(self, tensor_id: int, chunks: SavedChunks) -> None:
        self.chunk += chunks.indices
        self.tensor += [tensor_id] * len(chunks.indices)
        self.reused += chunks.reused or [False] * len(chunks.indices)
        for ref in chunks.refs or [None] * len(chunks.indices):
            file, offset, length = self._where(ref)
            self.file.append(file)
            self.offset.append(offset)
            self.length.append(length)

    def add_object(self, fqn: str, encoding: str, payload: Any, nbytes: int) -> None:
        self.objects[fqn] = {"encoding": object_values.JSON, "value": payload} if encoding == object_values.JSON \
            else {"encoding": encoding, "nbytes": nbytes}

    def place_object(self, fqn: str, ref: Ref | None) -> None:
        if ref is not None:
            self.objects[fqn]["ref"] = [self._where(ref)[0], ref.offset, ref.length]

    def done(self, stored: RankFiles | None) -> RankSummary:
        return RankSummary(self.rank, self.save_id, np.asarray(self.tensor, np.int32),
                           np.asarray(self.chunk, np.int64), np.asarray(self.file, np.int32),
                           np.asarray(self.offset, np.int64), np.asarray(self.length, np.int64),
                           np.asarray(self.reused, bool), tuple(self.files), stored, self.objects, self.placements)
