"""The packed layout: a checkpoint's Zarr keys in one OCDBT database over one data file per rank.

Each global tensor is still one Zarr v3 array with the same chunk grid; only
where its keys live changes. A packed checkpoint (format version 4) at ``BASE``
holds::

    zarr.json                   root group and metadata document, a plain file written last (the commit)
    manifest.ocdbt              the OCDBT manifest: points at the root of the B+tree
    d/<save id>.index           every B+tree node; the leaves map each array's and group's zarr.json
                                (stored inline) and every chunk key to bytes in a data file
    d/<save id>-<rank>          rank r's data file: its chunks and value blobs back to back, then its
                                digest table (on object stores: parts ``.<k>``, each one object)

Saving: every rank writes its values into its own data file
(:class:`~tsckpt.storage.sinks.RankFile`), so no two processes ever write one
file, and reports where each landed. At commit the coordinator writes the
B+tree over all of them and the manifest (:func:`write_index`,
:mod:`tsckpt.format.ocdbt`), then the root ``zarr.json``: a location without
it is an incomplete checkpoint exactly as in the plain layout.

Reading: tsckpt reads the node file once (its size is in the root document)
and every value by byte range from the data files (:class:`PackedIndex`);
TensorStore's ``zarr3`` driver over ``{"driver": "ocdbt", "base": BASE}``
(:func:`read_kvstore`) reads the same database, and
:func:`tsckpt.zarr_store` serves it to zarr-python. Checkpoints packed
before format version 4 (per-rank OCDBT databases under
``ocdbt.process_<r>/`` joined by TensorStore) are read through TensorStore.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorstore as ts

from ..errors import ChecksumError, MetadataError
from ..format import ocdbt, ocdbt_tree
from ..format.data_files import Span
from .kvio import kv_name, storage_error

#: The database's manifest, at the checkpoint's root.
MANIFEST = ocdbt.MANIFEST_KEY
#: Context resource holding decoded B+tree nodes for TensorStore readers (see :func:`reader_context`).
NODE_CACHE = "cache_pool#tsckpt_ocdbt"
NODE_CACHE_BYTES = 64 << 20
#: Largest B+tree node tsckpt writes (the manifest's ``max_decoded_node_bytes``).
MAX_NODE_BYTES = 8 << 20
#: Values up to this size are stored in the B+tree leaves (zarr.json documents); larger ones go
#: into the node file as values of their own.
MAX_INLINE_VALUE_BYTES = 64 << 10


def index_file(save_id: str) -> str:
    """The path, relative to the checkpoint, of save ``save_id``'s B+tree node file."""
    return f"d/{save_id}.index"


def _prefix(path: str) -> str:
    path = path.strip("/")
    return f"{path}/" if path else ""


def _under(base: Mapping[str, Any], relpath: str) -> dict[str, Any]:
    """The kvstore spec of a sub-directory of ``base`` (an absolute base path stays absolute)."""
    path = str(base.get("path", ""))
    if path and not path.endswith("/"):
        path += "/"
    return {**base, "path": path + _prefix(relpath)}


def root_database(base: Mapping[str, Any]) -> dict[str, Any]:
    """The OCDBT kvstore spec TensorStore reads a packed checkpoint's database through (any version).

    Decoded B+tree nodes are cached in :data:`NODE_CACHE`.
    """
    return {"driver": "ocdbt", "base": _under(base, ""), "cache_pool": NODE_CACHE}


def read_kvstore(base: Mapping[str, Any], path: str) -> dict[str, Any]:
    """Where TensorStore finds the array (or group) at ``path`` of a packed checkpoint."""
    return {**root_database(base), "path": _prefix(path)}


def reader_context(parent: ts.Context, cache_bytes: int = NODE_CACHE_BYTES) -> ts.Context:
    """A child of ``parent`` that defines :data:`NODE_CACHE`, which reader specs refer to.

    Make it once per reader and open every array with it: the decoded B+tree
    nodes are then read once, not once per chunk.
    """
    return ts.Context({NODE_CACHE: {"total_bytes_limit": cache_bytes}}, parent=parent)


def is_packed(kv: ts.KvStore) -> bool:
    """Whether the location behind the plain kvstore ``kv`` holds an OCDBT database.

    A plain checkpoint never has a key named ``manifest.ocdbt`` at its root
    (array paths hold directories, never a bare file of that name).
    """
    try:
        return kv.read(MANIFEST, byte_range=slice(0, 0)).result().state == "value"
    except ValueError as e:
        raise storage_error(e, f"cannot read {MANIFEST} at {kv_name(kv)}") from None


# --- the coordinator's step ---------------------------------------------------------


@dataclass
class StoredValues:
    """Where every chunk and blob value of a packed save is, in columns, in any order: value ``k`` is
    ``length[k]`` bytes at ``offset[k]`` of data file ``files[file[k]]``, under Zarr key ``keys[k]``."""

    keys: list[bytes]
    file: np.ndarray  # int64
    offset: np.ndarray  # int64
    length: np.ndarray  # int64
    files: list[str]


def merged_entries(docs: Mapping[str, bytes], values: StoredValues) -> ocdbt.Entries:
    """Node documents (inline) and data-file values in one sorted :class:`~tsckpt.format.ocdbt.Entries`."""
    keys = [k.encode() for k in docs] + values.keys
    order = np.asarray(sorted(range(len(keys)), key=keys.__getitem__), dtype=np.int64)
    n = len(docs)
    inline: list[bytes | None] = [*docs.values(), *([None] * len(values.keys))]
    file = np.concatenate([np.full(n, -1, np.int64), values.file])
    offset = np.concatenate([np.zeros(n, np.int64), values.offset])
    length = np.concatenate([np.zeros(n, np.int64), values.length])
    return ocdbt.Entries([keys[k] for k in order.tolist()], [inline[k] for k in order.tolist()], file[order],
                         offset[order], length[order], list(values.files))



def write_index(kv: ts.KvStore, save_id: str, entries: ocdbt.Entries, where: str,
                fence: Callable[[], None] = lambda: None) -> Span | None:
    """Write the B+tree over ``entries`` as node file :func:`index_file` and the manifest pointing at it.

    ``entries``: every key of the checkpoint but the root document, sorted,
    each with its value inline or its place in a data file. The node file is
    written first, so a manifest never points at nodes that are not there;
    both before the root document, which alone commits the checkpoint.
    ``fence`` runs while the node file, named by the save, is on its way; the
    manifest, at a name every save writes, waits for it.
    """
    if not entries.keys:  # a save of no arrays has nothing to index
        fence()
        return None
    path = index_file(save_id)
    # Values too large for a leaf (a zarr.json with a long placement) go first into the node file.
    large = [k for k, v in enumerate(entries.inline) if v is not None and len(v) > MAX_INLINE_VALUE_BYTES]
    head = b"".join(entries.inline[k] or b"" for k in large)
    if large:
        if path not in entries.files:
            entries.files.append(path)
        at = 0
        for k in large:
            size = len(entries.inline[k] or b"")
            entries.file[k], entries.offset[k], entries.length[k] = entries.files.index(path), at, size
            entries.inline[k], at = None, at + size
    tree = ocdbt_tree.build_tree(entries, path=path, max_node_bytes=MAX_NODE_BYTES, start=len(head))
    manifest = ocdbt.Manifest(ocdbt.new_uuid(), tree.root, tree.height, tree.stats, time.time_ns(),
                              max_inline_value_bytes=MAX_INLINE_VALUE_BYTES, max_decoded_node_bytes=MAX_NODE_BYTES)
    nodes = kv.write(path, head + tree.nodes)
    try:
        fence()  # on an object store a round trip, overlapping the node file's
    except BaseException:
        with contextlib.suppress(ValueError):
            nodes.result()  # nothing of this save may land after the clean-up that follows
        raise
    try:
        nodes.result()
        kv.write(MANIFEST, manifest.encode()).result()
    except ValueError as e:
        raise storage_error(e, f"writing the packed index of {where} failed") from None
    return Span(path, len(head), len(tree.nodes))


# --- readers ------------------------------------------------------------------------


@dataclass
class PackedIndex:
    """A version-4 packed checkpoint's B+tree, decoded: every key's inline value or where it is stored."""

    values: dict[str, bytes | ocdbt.Ref]

    @classmethod
    def decode(cls, nodes: bytes | memoryview | np.ndarray, where: str,
               files: Collection[str] | None = None) -> PackedIndex:
        """Every leaf of the B+tree nodes ``nodes`` (as :func:`write_index` writes them: back to back).

        ``files``: the data files the root document lists; a value stored in any other file (a path the
        index was made to name, outside the checkpoint or not) is refused.
        """
        data = memoryview(nodes).cast("B")
        values: dict[str, bytes | ocdbt.Ref] = {}
        at, last = 0, b""
        try:
            while at < len(data):
                if len(data) - at < 12:
                    raise ocdbt.OcdbtFormatError(f"{where}: ends inside a node header")
                length = int.from_bytes(data[at + 4:at + 12], "little")
                if length < 12 or at + length > len(data):
                    raise ocdbt.OcdbtFormatError(f"{where}: a node at byte {at} runs past the end of the file")
                node = ocdbt.decode_node(data[at:at + length], f"{where} (node at byte {at})")
                at += length
                if node.height:
                    continue
                if node.keys[0] <= last:
                    raise ocdbt.OcdbtFormatError(f"{where}: leaves out of key order")
                last = node.keys[-1]
                for key, value in zip(node.keys, node.values):
                    values[key.decode("utf-8", "surrogateescape")] = value
        except ocdbt.OcdbtFormatError as e:
            raise (ChecksumError if "crc32c" in str(e) else MetadataError)(str(e)) from None
        if files is not None:
            allowed = set(files)
            stray = next((v.path for v in values.values() if isinstance(v, ocdbt.Ref) and v.path not in allowed), None)
            if stray is not None:
                raise MetadataError(f"{where}: a value is stored in {stray!r}, which is not one of the checkpoint's "
                                    "data files")
        return cls(values)

    def get(self, key: str) -> bytes | ocdbt.Ref | None:
        return self.values.get(key)
