"""Plain-data views of an opened checkpoint: the ``--json`` documents, group members and value selections.

The JSON documents printed by ``tsckpt ls --json``, ``tsckpt info --json`` and
``tsckpt verify --json`` are built here. Their keys are stable: later versions
may add keys, never rename or remove one.

``ls --json`` (:func:`listing`)::

    {"location": str, "world_size": int,
     "tensors": [{"key": str, "key_path": [str | int, ...], "path": str, "shape": [int, ...],
                  "dtype": str, "nbytes": int, "chunk_shape": [int, ...],
                  "inner_chunk_shape": [int, ...] | null,
                  "placement": str, "placement_spec": {...} | null}, ...],
     "values": [{"key": str, "key_path": [...], "encoding": "json" | "torch", "value": any | null}, ...],
     "totals": {"tensors": int, "nbytes": int, "values": int},
     "reuse": {"base": str, "base_save_id": str | null, "chunks_reused": int, "bytes_reused": int,
               "bytes_written": int, "note": str | null} | null}

``dtype`` is the Zarr data type name (``bfloat16``, ``float32``...);
``reuse`` is what an incremental save took from its base (``null`` for a full
save; docs/format.md, section 2); ``placement`` is the one-line text ``ls`` shows and ``placement_spec`` the
metadata's record of it. A value is given only for ``json`` encoded values
(tuples become lists, non-string keys strings, NaN and infinities the strings
``"nan"``, ``"inf"``, ``"-inf"``); ``torch`` encoded ones have ``null``.

``info --json`` (:func:`information`)::

    {"location": str, "format_version": int, "tsckpt_version": str | null,
     "torch_version": str | null, "created": str | null, "world_size": int,
     "meshes": [{"shape": [...], "dim_names": [...] | null, "device_type": str, "ranks": [...]}, ...],
     "tensors": int, "tensor_nbytes": int, "values": int, "layout": "plain" | "packed", "files": int,
     "bytes_stored": int | null, "content_hash": str | null, "reuse": {...} | null}

``verify --json`` (:func:`verification`)::

    {"location": str, "ok": bool, "arrays": int, "failed": int, "chunks": int, "nbytes": int,
     "entries": [{"key": str, "path": str, "nbytes": int, "chunks": int, "problems": [str, ...],
                  "problem_files": [str | null, ...], "stored_in": [str, ...], "kind": "tensor" | "value"}, ...],
     "files": {... as an entry, "kind": "files"} | null}

``problem_files`` names the file or object each problem is about (null: none in particular), and
``stored_in`` the files holding the entry's chunks; ``files`` is the data files, chunk tables and
index, checked whole.

Torch-free.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ..read.index import SelectionError, parse_index

if TYPE_CHECKING:
    from ..read.checkpoint import Checkpoint
    from ..read.verify_report import VerifyReport


def plain(value: Any) -> Any:
    """``value`` as strict JSON data: tuples as lists, keys as strings, non-finite floats as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    return value


def listing(ck: Checkpoint) -> dict[str, Any]:
    """The ``ls --json`` document of ``ck``."""
    md = ck.metadata
    tensors = [{"key": key, "key_path": list(e.key_path), "path": e.path, "shape": list(e.shape),
                "dtype": e.dtype, "nbytes": e.nbytes, "chunk_shape": list(e.chunk_shape),
                "inner_chunk_shape": list(e.inner_chunk_shape) if e.inner_chunk_shape else None,
                "placement": ck.tensors[key].placement_text,
                "placement_spec": e.placement.to_dict() if e.placement else None}
               for key, e in md.tensors.items()]
    values = [{"key": key, "key_path": list(e.key_path), "encoding": e.encoding,
               "value": plain(ck[key]) if e.encoding == "json" else None}
              for key, e in md.objects.items()]
    return {"location": ck.url, "world_size": ck.world_size, "tensors": tensors, "values": values,
            "totals": {"tensors": len(tensors), "nbytes": sum(t["nbytes"] for t in tensors), "values": len(values)},
            "reuse": md.reuse.to_dict() if md.reuse else None}


def information(ck: Checkpoint) -> dict[str, Any]:
    """The ``info --json`` document of ``ck``."""
    md = ck.metadata
    files, stored = ck.storage_stats()
    return {"location": ck.url, "format_version": md.version, "tsckpt_version": md.tsckpt_version or None,
            "torch_version": md.torch_version or None, "created": md.created or None, "world_size": md.world_size,
            "meshes": [m.to_dict() for m in md.meshes], "tensors": len(md.tensors), "tensor_nbytes": ck.nbytes,
            "values": len(md.objects), "layout": md.layout, "files": files, "bytes_stored": stored,
            "content_hash": md.content_hash, "reuse": md.reuse.to_dict() if md.reuse else None}


def verification(report: VerifyReport) -> dict[str, Any]:
    """The ``verify --json`` document of a :class:`~tsckpt.read.verify_report.VerifyReport`."""
    return {**report.to_dict(), "arrays": len(report.entries), "failed": len(report.failed),
            "chunks": report.chunks, "nbytes": report.nbytes}


def members(ck: Checkpoint, group: str) -> list[str]:
    """The keys of every tensor and value under ``group``, in checkpoint order.

    ``group`` is a dotted key prefix (``model.layers``) or a Zarr group path
    (``model/layers.0``); an empty list when nothing is under it.
    """
    dotted, slashed = group.rstrip("."), group.strip("/")
    if not dotted or not slashed:
        return list(ck)
    out = []
    for key in ck:
        entry = ck.metadata.tensors.get(key) or ck.metadata.objects[key]
        path = "/".join(str(p) for p in entry.key_path)
        if key.startswith(dotted + ".") or path.startswith(slashed + "/"):
            out.append(key)
    return out


def select_value(value: Any, index: str, key: str) -> Any:
    """Apply the command-line ``index`` (``"1:3"``, ``"-1"``, ``"0,2"``) to a plain value.

    Lists, tuples and strings are indexed like Python sequences; each further
    comma-separated item indexes one level deeper, numpy-style (``"0:2,1"`` is
    item 1 of each of the first two elements). Arrays and tensors take the
    whole index at once.
    """
    items = parse_index(index)
    if hasattr(value, "shape") and hasattr(value, "__getitem__"):
        try:
            return value[items]
        except (IndexError, TypeError, ValueError) as e:
            raise SelectionError(f"value {key!r}: cannot apply [{index}]: {e}") from None
    return _select(value, items, key, index)


def _select(value: Any, items: tuple[Any, ...], key: str, index: str) -> Any:
    if not items:
        return value
    head, rest = items[0], items[1:]
    if head is Ellipsis:
        if rest:
            raise SelectionError(f"value {key!r}: '...' is only allowed last in [{index}] for a plain value")
        return value
    if not isinstance(value, (list, tuple, str)):
        raise SelectionError(f"value {key!r}: cannot apply [{index}] to a value of type {type(value).__name__}; "
                             "only lists, tuples and strings can be indexed")
    if isinstance(value, str) and rest:
        raise SelectionError(f"value {key!r}: [{index}] has {len(items)} indices for a string (one dimension)")
    if isinstance(head, int):
        if not -len(value) <= head < len(value):
            raise SelectionError(f"value {key!r}: index {head} is out of range for a "
                                 f"{type(value).__name__} of length {len(value)}")
        return _select(value[head], rest, key, index)
    picked = value[head]
    return type(value)(_select(v, rest, key, index) for v in picked) if rest else picked
