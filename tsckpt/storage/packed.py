"""The packed layout: a checkpoint's Zarr keys in one OCDBT database over one data file per rank (docs/format.md).

Every rank writes its values into its own data file (:class:`~tsckpt.storage.sinks.Sink`); at commit the
coordinator writes the B+tree over all of them and the manifest (:mod:`tsckpt.storage.packed_index`). tsckpt
reads only the nodes on the way to the keys it needs (:class:`BTreeIndex`); TensorStore's ``zarr3`` driver reads
the same database through :func:`read_kvstore`, and :func:`tsckpt.zarr_store` serves it to zarr-python.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorstore as ts

from ..errors import ChecksumError, MetadataError
from ..format import ocdbt
from ..format.data_files import Span
from .kvio import kv_name, storage_error

if TYPE_CHECKING:
    from .locator import ReadSpans  # which imports this module

#: The database's manifest, at the checkpoint's root.
MANIFEST = ocdbt.MANIFEST_KEY
#: Context resource holding decoded B+tree nodes for TensorStore readers (see :func:`reader_context`).
NODE_CACHE = "cache_pool#tsckpt_ocdbt"
NODE_CACHE_BYTES = 64 << 20
#: The size tsckpt cuts nodes at (a node holding one larger value is larger): a lookup reads one node per
#: level, so small nodes keep what a rank reads in proportion to the keys it looks up, while the tree stays
#: a few levels deep (16 KiB nodes of 30-byte chunk keys: about 500 keys a node, 3 levels for 100 M keys).
NODE_BYTES = 16 << 10


def read_kvstore(base: Mapping[str, Any], path: str) -> dict[str, Any]:
    """Where TensorStore finds the array (or group) at ``path`` of a packed checkpoint: the OCDBT database
    over ``base`` (an absolute base path stays absolute), its decoded nodes cached in :data:`NODE_CACHE`."""
    root, path = str(base.get("path", "")), path.strip("/")
    if root and not root.endswith("/"):
        root += "/"
    return {"driver": "ocdbt", "base": {**base, "path": root}, "cache_pool": NODE_CACHE,
            "path": f"{path}/" if path else ""}


def reader_context(parent: ts.Context) -> ts.Context:
    """A child of ``parent`` that defines :data:`NODE_CACHE`, which reader specs refer to: open every array of a
    reader with it, and the decoded B+tree nodes are read once, not once per chunk."""
    return ts.Context({NODE_CACHE: {"total_bytes_limit": NODE_CACHE_BYTES}}, parent=parent)


def is_packed(kv: ts.KvStore) -> bool:
    """Whether the location behind the plain kvstore ``kv`` holds an OCDBT database (a plain checkpoint never
    has a key named ``manifest.ocdbt`` at its root: array paths hold directories)."""
    try:
        return kv.read(MANIFEST, byte_range=slice(0, 0)).result().state == "value"
    except ValueError as e:
        raise storage_error(e, f"cannot read {MANIFEST} at {kv_name(kv)}") from None


@dataclass
class StoredValues:
    """Where every chunk and blob value of a packed save is, in columns: chunk value ``k`` is ``length[k]`` bytes
    at ``offset[k]`` of data file ``files[file[k]]``, in any order; ``position`` says which value is each chunk of
    each array of ``arrays`` (its path and chunk grid) in row-major grid order, array after array (None: the
    columns are in that order). ``blobs``: each value blob's key and where it is, ``(key, file, offset, length)``.
    """

    arrays: list[tuple[str, tuple[int, ...]]]
    blobs: list[tuple[str, int, int, int]]
    file: np.ndarray  # int32 or int64
    offset: np.ndarray  # int64
    length: np.ndarray  # int64
    files: list[str]
    position: np.ndarray | None = None


class BTreeIndex:
    """A packed checkpoint's B+tree as a reader walks it: only the nodes on the way to the keys it asks for.

    ``root`` is the root node's span (``data_files.index``); every other node lies before it in the same file,
    read level by level when a lookup first needs it, all the nodes a level needs in one call of ``read`` (a file
    of at most ``whole_up_to`` bytes at once). ``files``: the data files the root document lists; a value stored
    in any other file (a path the index was made to name) is refused.
    """

    def __init__(self, root: Span, read: ReadSpans, files: Collection[str], where: str, whole_up_to: int = 0):
        self.root = root
        self.where = where
        self._read = read
        self._files = frozenset(files)
        self._nodes: dict[int, ocdbt.Node] = {}  # by offset in the file
        self._whole: np.ndarray | None = None
        self._whole_up_to = whole_up_to
        #: Every key looked up so far: its inline value, where it is stored, or None (no such key).
        self.values: dict[str, bytes | ocdbt.Ref | None] = {}
        #: Node bytes read, in all.
        self.bytes_read = 0

    def lookup(self, keys: Iterable[str]) -> None:
        """Find every key of ``keys`` not looked up before, reading the nodes on their paths."""
        wanted = sorted({k.encode("utf-8", "surrogateescape") for k in keys if k not in self.values})
        if wanted:
            self._descend(wanted)

    def everything(self) -> dict[str, bytes | ocdbt.Ref]:
        """Every key of the tree and its value, reading and checking every node (``verify``)."""
        return self._descend(None)

    def _descend(self, wanted: list[bytes] | None) -> dict[str, bytes | ocdbt.Ref]:
        """Walk down from the root to the leaves holding ``wanted`` (sorted), or to every leaf (None); record what
        it found in :attr:`values` (None for a wanted key the tree lacks) and return the keys found."""
        found: dict[str, bytes | ocdbt.Ref | None] = {}
        level: list[tuple[ocdbt.Ref, int, list[bytes] | None, bytes, bytes | None]] = [
            (ocdbt.Ref(self.root.path, self.root.offset, self.root.length), -1, wanted, b"", None)]
        while level:
            self._fetch([ref for ref, *_ in level])
            below: list[tuple[ocdbt.Ref, int, list[bytes] | None, bytes, bytes | None]] = []
            for ref, height, ks, low, high in level:
                node = self._node(ref, height, low, high)
                if node.height == 0:
                    if ks is None:
                        found.update((k.decode("utf-8", "surrogateescape"), v) for k, v in zip(node.keys, node.values))
                    for k in ks or ():
                        at = bisect.bisect_left(node.keys, k)
                        hit = at < len(node.keys) and node.keys[at] == k
                        found[k.decode("utf-8", "surrogateescape")] = node.values[at] if hit else None
                    continue
                bounds = [*node.keys[1:], high]
                if ks is None:
                    below += [(c, node.height - 1, None, k, b) for c, k, b in zip(node.values, node.keys, bounds)
                              if isinstance(c, ocdbt.Ref)]
                    continue
                for k in ks:
                    at = bisect.bisect_right(node.keys, k) - 1
                    if at < 0:  # before the subtree's first key: not stored
                        found[k.decode("utf-8", "surrogateescape")] = None
                        continue
                    child = node.values[at]
                    assert isinstance(child, ocdbt.Ref)
                    if below and below[-1][0] == child:
                        below[-1][2].append(k)  # type: ignore[union-attr]
                    else:
                        below.append((child, node.height - 1, [k], node.keys[at], bounds[at]))
            level = below
        self.values.update(found)
        return {k: v for k, v in found.items() if v is not None}

    def _fetch(self, refs: Sequence[ocdbt.Ref]) -> None:
        """Read the nodes of ``refs`` not read before (the whole file at once where it is small)."""
        todo = sorted({r.offset: r for r in refs if r.offset not in self._nodes}.values(), key=lambda r: r.offset)
        end = self.root.offset + self.root.length
        for ref in todo:
            if ref.path != self.root.path or ref.offset + ref.length > end or ref.length < 12:
                raise MetadataError(f"{self.where}: a node at {ref.path!r} bytes {ref.offset}+{ref.length} is not "
                                    "within the index")
        if not todo:
            return
        if self._whole is None and end <= self._whole_up_to:
            [self._whole] = self._read([(self.root.path, 0, end)])
            self.bytes_read += end
        if self._whole is not None:
            data = [self._whole[r.offset:r.offset + r.length] for r in todo]
        else:
            data = self._read([(r.path, r.offset, r.length) for r in todo])
            self.bytes_read += sum(r.length for r in todo)
        for ref, raw in zip(todo, data):
            if len(raw) != ref.length:
                raise MetadataError(f"{self.where}: the node at byte {ref.offset} is cut short")
            try:
                self._nodes[ref.offset] = ocdbt.decode_node(memoryview(raw).cast("B"),
                                                            f"{self.where} (node at byte {ref.offset})")
            except ocdbt.OcdbtFormatError as e:
                raise (ChecksumError if "crc32c" in str(e) else MetadataError)(str(e)) from None

    def _node(self, ref: ocdbt.Ref, height: int, low: bytes, high: bytes | None) -> ocdbt.Node:
        """The node at ``ref``, checked against where its parent put it: ``height`` (-1: the root) and keys in
        ``[low, high)``, in order; its values in the checkpoint's data files."""
        node = self._nodes[ref.offset]
        at = f"{self.where}: the node at byte {ref.offset}"
        if height >= 0 and node.height != height:
            raise MetadataError(f"{at} has height {node.height}, not the {height} its parent gives it")
        keys = node.keys
        if keys[0] < low or (high is not None and keys[-1] >= high) or any(a >= b for a, b in zip(keys, keys[1:])):
            raise MetadataError(f"{at}: keys out of order")
        if node.height == 0:
            stray = next((v.path for v in node.values if isinstance(v, ocdbt.Ref) and v.path not in self._files),
                         None)
            if stray is not None:
                raise MetadataError(f"{self.where}: a value is stored in {stray!r}, which is not one of the "
                                    "checkpoint's data files")
        return node
