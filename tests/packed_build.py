"""Build plain or packed checkpoints from numpy arrays the way the writer does, rank by rank.

Used by the packed-layout unit tests and ``benchmarks/bench_packed.py`` to
drive the layout below the DCP writer (options, transactions, one process
playing every rank): each "rank" writes the rows it owns of
every tensor (``Shard(0)`` with ``torch.chunk`` sizes) through TensorStore with
``assume_metadata``, exactly as ``TensorStoreWriter.write_data`` does, and the
coordinator then commits through ``tsckpt.format.commit.commit``. For the packed layout
the coordinator first joins the ranks' databases and writes the array and
group documents into the joined database.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorstore as ts

from tsckpt.format import commit as hierarchy
from tsckpt.format import zarr_json as arrays
from tsckpt.format.metadata import CheckpointMetadata, ReplicatedPlacement, TensorEntry
from tsckpt.format.names import zarr_path
from tsckpt.location import Location, make_context, open_kvstore, parse_location, unsynced_nodes
from tsckpt.packed import PackedLayout, PackedOptions

LAYOUTS = ("plain", "packed")


@dataclass(frozen=True)
class Tensor:
    """One global tensor of a synthetic checkpoint, row-sharded over the ranks."""

    key_path: tuple[str, ...]
    data: np.ndarray
    dtype: str  # Zarr data type name
    #: Zarr v3 ``dimension_names`` (tsckpt writes none today; xarray needs them).
    dims: tuple[str, ...] | None = None

    @property
    def path(self) -> str:
        return zarr_path(self.key_path)

    @property
    def key(self) -> str:
        return ".".join(self.key_path)

    def chunk_rows(self, world_size: int) -> int:
        n = self.data.shape[0] if self.data.ndim else 1
        return max(math.ceil(n / world_size), 1)

    def rows(self, rank: int, world_size: int) -> slice:
        if self.data.ndim == 0:
            return slice(0, 1 if rank == 0 else 0)
        c = self.chunk_rows(world_size)
        n = self.data.shape[0]
        return slice(min(rank * c, n), min((rank + 1) * c, n))

    def rank_nbytes(self, rank: int, world_size: int) -> int:
        rows = self.rows(rank, world_size)
        n = self.data.shape[0] if self.data.ndim else 1
        return max(rows.stop - rows.start, 0) * self.data.nbytes // max(n, 1)

    def chunk_shape(self, world_size: int) -> list[int]:
        if self.data.ndim == 0:
            return []
        return [self.chunk_rows(world_size), *self.data.shape[1:]]

    def zarr_metadata(self, world_size: int, attributes: dict[str, Any] | None = None) -> dict[str, Any]:
        doc = arrays.array_metadata(list(self.data.shape), self.dtype, self.chunk_shape(world_size),
                                    attributes=attributes, checksums=False)
        return doc | {"dimension_names": list(self.dims)} if self.dims is not None else doc


def _base(location: Location) -> dict[str, Any]:
    return dict(location.spec)


def chunk_kvstore(layout: str, location: Location, rank: int, path: str,
                  options: PackedOptions | None = None) -> dict[str, Any]:
    if layout == "packed":
        return PackedLayout(options or PackedOptions()).write_kvstore(_base(location), rank, path)
    return location.child(path)


def write_rank(location: Any, tensors: Sequence[Tensor], rank: int, world_size: int, *,
               layout: str, context: ts.Context | None = None, transaction: bool = False,
               options: PackedOptions | None = None) -> int:
    """Write rank ``rank``'s rows of every tensor; returns the bytes written.

    With ``transaction`` every write of the rank goes through one atomic
    transaction, committed at the end: in the packed layout that is one OCDBT
    commit, so the rank's database gets one data file per target file size.
    """
    loc = parse_location(location)
    context = context or make_context(location=loc)
    txn = PackedLayout().rank_transaction() if transaction else None
    opened = []
    for t in tensors:
        rows = t.rows(rank, world_size)
        if rows.stop <= rows.start:
            continue
        spec = {"driver": "zarr3", "kvstore": chunk_kvstore(layout, loc, rank, t.path, options),
                "metadata": t.zarr_metadata(world_size), "assume_metadata": True,
                "store_data_equal_to_fill_value": True}
        opened.append((t, rows, ts.open(spec, context=context)))
    pending, nbytes = [], 0
    for t, rows, fut in opened:
        arr = fut.result() if txn is None else fut.result().with_transaction(txn)
        if t.data.ndim == 0:
            pending.append(arr.write(t.data))
        else:
            part = t.data[rows]
            pending.append(arr[rows].write(part, can_reference_source_data_indefinitely=True))
        nbytes += t.rank_nbytes(rank, world_size)
    for f in pending:
        f.result()
    if txn is not None:
        txn.commit_async().result()
    return nbytes


def metadata(tensors: Sequence[Tensor], world_size: int, layout: str = "plain") -> CheckpointMetadata:
    """A format-version-1 document (no checksums: readers take codecs from each array's zarr.json)."""
    entries = {t.key: TensorEntry(t.key_path, t.path, tuple(t.data.shape), t.dtype,
                                  tuple(t.chunk_shape(world_size)), None, ReplicatedPlacement())
               for t in tensors}
    return CheckpointMetadata(world_size=world_size, tensors=entries, objects={}, extra={"save_id": "test"},
                              version=1, layout=layout)


def prepare(location: Any, *, layout: str, context: ts.Context | None = None) -> None:
    """The coordinator's set-up: refuse nothing (tests use fresh locations), clear packed leftovers."""
    loc = parse_location(location)
    if layout == "packed":
        PackedLayout().prepare(open_kvstore(loc, context or make_context(location=loc)))


def commit(location: Any, tensors: Sequence[Tensor], world_size: int, *, layout: str,
           context: ts.Context | None = None, extra_root: Mapping[str, Any] | None = None,
           options: PackedOptions | None = None) -> None:
    """The coordinator's finish: (join), array and group documents, then the root document."""
    loc = parse_location(location)
    context = context or make_context(location=loc)
    md = metadata(tensors, world_size, layout)
    docs = {t.path: t.zarr_metadata(world_size, {"tsckpt": {"kind": "tensor", "key": t.key}}) for t in tensors}
    kv = open_kvstore(loc, context)
    if layout == "packed":
        nodes = PackedLayout(options or PackedOptions()).join(_base(loc), world_size, context)
    else:
        nodes = unsynced_nodes(loc)
    if extra_root:
        # The root document with extra fields (e.g. the layout) that CheckpointMetadata does not know yet.
        doc = md.to_dict() | dict(extra_root)
        md = _Raw(doc)  # type: ignore[assignment]
    hierarchy.commit(kv, md, docs, nodes=nodes)


class _Raw:
    def __init__(self, doc: dict[str, Any]):
        self._doc = doc

    def to_dict(self) -> dict[str, Any]:
        return self._doc


def save(location: Any, tensors: Sequence[Tensor], world_size: int, *, layout: str) -> None:
    """All ranks in this process, one context and (packed) one transaction each, then the commit."""
    prepare(location, layout=layout)
    for rank in range(world_size):
        write_rank(location, tensors, rank, world_size, layout=layout, transaction=layout == "packed")
    commit(location, tensors, world_size, layout=layout)


def files(location: Any) -> list[str]:
    """Every key (file or object) under the location, as the plain kvstore lists them."""
    loc = parse_location(location)
    kv = open_kvstore(loc, make_context(location=loc))
    return sorted(k.decode() for k in kv.list().result())
