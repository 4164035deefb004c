"""The packed layout: a checkpoint's Zarr keys in one OCDBT database over one data file per rank.

Each global tensor is still one Zarr v3 array with the same chunk grid; only
where its keys live changes. A packed checkpoint at ``BASE`` holds::

    zarr.json                   root group and metadata document, a plain file written last (the commit)
    manifest.ocdbt              the OCDBT manifest: points at the root of the B+tree
    d/<save id>.index           every B+tree node, the root last; the leaves map each array's and group's
                                zarr.json (stored inline) and every chunk key to bytes in a data file
    d/<save id>-<rank>          rank r's data file: its chunks and value blobs back to back, then its
                                digest table (on object stores: parts ``.<k>``, each one object)

Saving: every rank writes its values into its own data file
(:class:`~tsckpt.storage.sinks.Sink`), so no two processes write one file, and
reports where each landed. At commit the coordinator writes the B+tree over all
of them and the manifest (:func:`write_index`), then the root ``zarr.json``: a
location without it is an incomplete checkpoint, as in the plain layout.

Reading: tsckpt finds the root node through the root document
(``data_files.index``) and reads only the nodes on the way to the keys it
needs (:class:`BTreeIndex`), then every value by byte range from the data
files; TensorStore's ``zarr3`` driver over ``{"driver": "ocdbt", "base":
BASE}`` (:func:`read_kvstore`) reads the same database, and
:func:`tsckpt.zarr_store` serves it to zarr-python.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import itertools
import os
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorstore as ts

from ..errors import ChecksumError, MetadataError
from ..format import ocdbt, ocdbt_keys, ocdbt_tree, zarr_json
from ..format.data_files import Span
from .kvio import kv_name, storage_error
from .localfs import fsync_dir
from .locator import ReadSpans

#: The database's manifest, at the checkpoint's root.
MANIFEST = ocdbt.MANIFEST_KEY
#: Context resource holding decoded B+tree nodes for TensorStore readers (see :func:`reader_context`).
NODE_CACHE = "cache_pool#tsckpt_ocdbt"
NODE_CACHE_BYTES = 64 << 20
#: Largest B+tree node a reader must accept (the manifest's ``max_decoded_node_bytes``).
MAX_NODE_BYTES = 8 << 20
#: The size tsckpt cuts nodes at (a node holding one larger value is larger): a lookup reads one node per
#: level, so small nodes keep what a rank reads in proportion to the keys it looks up, while the tree stays
#: a few levels deep (16 KiB nodes of 30-byte chunk keys: about 500 keys a node, 3 levels for 100 M keys).
NODE_BYTES = 16 << 10
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
    """The OCDBT kvstore spec TensorStore reads a packed checkpoint's database through.

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


@functools.lru_cache(maxsize=64)
def grid_tails(grid: tuple[int, ...]) -> tuple[ocdbt_keys.Tails, np.ndarray]:
    """The chunk keys of a grid (``c/i/j``, as the array's ``zarr.json`` names them) in sorted order, and the
    row-major index of each: every array of that grid shares them."""
    return ocdbt_keys.sorted_tails([zarr_json.chunk_key(index).encode()
                                    for index in itertools.product(*map(range, grid))])


def merged_entries(docs: Mapping[str, bytes], values: StoredValues) -> ocdbt.Entries:
    """Node documents (inline) and data-file values in one sorted :class:`~tsckpt.format.ocdbt.Entries`.

    Each array's chunk keys are one run (its path, then its grid's keys in
    sorted order), which no other key falls inside: so runs sorted by their
    first key are the keys sorted, without a key of its own per chunk. The
    columns are filled run by run, each array's values gathered straight into
    key order: no column of the whole index is made twice.
    """
    runs: list[tuple[ocdbt_keys.KeyRun, tuple[int, np.ndarray] | tuple[int, int, int] | bytes]] = []
    at = 0
    for path, grid in values.arrays:
        tails, order = grid_tails(grid)
        if len(tails):  # an empty array has no chunk
            runs.append((ocdbt_keys.KeyRun(f"{path}/".encode(), tails), (at, order)))
        at += len(tails)
    runs += [(ocdbt_keys.KeyRun(key.encode()), (file, offset, length)) for key, file, offset, length in values.blobs]
    runs += [(ocdbt_keys.KeyRun(key.encode()), doc) for key, doc in docs.items()]
    runs.sort(key=lambda r: r[0].first())
    keys = ocdbt_keys.SortedKeys([r for r, _ in runs])
    n = len(keys)
    file = np.empty(n, np.result_type(values.file, np.int32))
    offset, length = np.empty(n, np.int64), np.empty(n, np.result_type(values.length, np.int32))
    inline: dict[int, bytes] = {}
    arrays = []
    for a, (_, what) in zip(keys.run_starts.tolist(), runs):
        if isinstance(what, bytes):
            inline[a] = what
            file[a], offset[a], length[a] = -1, 0, 0
        elif len(what) == 3:
            file[a], offset[a], length[a] = what
        else:
            arrays.append((what[0], a, what[1]))
    # Arrays in the order their values are numbered, not in key order: a rank stores its arrays' values
    # together, so an array's rows share cache lines with the next array's, which are read while still cached.
    scratch: dict[np.dtype, np.ndarray] = {}
    for start, a, order in sorted(arrays, key=lambda r: r[0]):
        b = a + len(order)
        if values.position is not None:
            rows = values.position[start:start + len(order)][order]
            file[a:b], offset[a:b], length[a:b] = values.file[rows], values.offset[rows], values.length[rows]
            continue
        for into, column in ((file, values.file), (offset, values.offset), (length, values.length)):
            _take(column[start:start + len(order)], order, into[a:b], scratch)
    return ocdbt.Entries(keys, inline, file, offset, length, list(values.files))


def _take(values: np.ndarray, order: np.ndarray, into: np.ndarray, scratch: dict[np.dtype, np.ndarray]) -> None:
    """``into[:] = values[order]`` with no new arrays (they took most of the time, for every chunk); a column
    narrower than ``into`` through reused scratch space. ``mode="clip"`` writes straight into ``out``."""
    if values.dtype == into.dtype:
        np.take(values, order, out=into, mode="clip")
        return
    buffer = scratch.get(values.dtype)
    if buffer is None or len(buffer) < len(order):
        buffer = scratch[values.dtype] = np.empty(len(order), values.dtype)
    np.take(values, order, out=buffer[:len(order)], mode="clip")
    into[:] = buffer[:len(order)]


def write_index(kv: ts.KvStore, save_id: str, entries: ocdbt.Entries, where: str,
                fence: Callable[[], None] = lambda: None, node_bytes: int = NODE_BYTES, *,
                local_root: str | None = None, sync: bool = True) -> Span | None:
    """Write the B+tree over ``entries`` as node file :func:`index_file` and the manifest pointing at it.

    ``entries``: every key of the checkpoint but the root document, sorted,
    each with its value inline or its place in a data file. The node file is
    written first, so a manifest never points at nodes that are not there;
    both before the root document, which alone commits the checkpoint.
    ``fence`` runs while the node file, named by the save, is on its way; the
    manifest, at a name every save writes, waits for it. ``local_root``: the
    checkpoint's directory when it is on a local disk, where the node file is
    written straight into its file (fsynced with ``sync``) rather than through ``kv``.
    """
    if not len(entries):  # a save of no arrays has nothing to index
        fence()
        return None
    path = index_file(save_id)
    # Values too large for a leaf (a zarr.json with a long placement) go first into the node file.
    large = sorted(k for k, v in entries.inline.items() if len(v) > MAX_INLINE_VALUE_BYTES)
    head = b"".join(entries.inline[k] for k in large)
    if large:
        if path not in entries.files:
            entries.files.append(path)
        at = 0
        for k in large:
            size = len(entries.inline.pop(k))
            entries.file[k], entries.offset[k], entries.length[k] = entries.files.index(path), at, size
            at += size
    try:
        if local_root is None:
            tree = ocdbt_tree.build_tree(entries, path=path, max_node_bytes=node_bytes, head=head)
            nodes = kv.write(path, tree.nodes)
        else:
            tree, nodes = _write_file(os.path.join(local_root, path), sync, entries, path=path,
                                      max_node_bytes=node_bytes, head=head)
    except OSError as e:
        raise storage_error(e, f"writing the packed index of {where} failed") from None
    manifest = ocdbt.Manifest(ocdbt.new_uuid(), tree.root, tree.height, tree.stats, time.time_ns(),
                              max_inline_value_bytes=MAX_INLINE_VALUE_BYTES, max_decoded_node_bytes=MAX_NODE_BYTES)
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
    return Span(path, tree.root.offset, tree.root.length)


class _Written:
    """A write already done, waited for as a TensorStore write is."""

    def result(self) -> None:
        return None


def _write_file(full: str, sync: bool, entries: ocdbt.Entries, **tree: Any) -> tuple[ocdbt_tree.Tree, _Written]:
    """Build the B+tree of ``entries`` straight into node file ``full`` as it is encoded: TensorStore copies a
    value twice before it writes it (600 MB of new pages for an index of 300 MB), and a whole file built in
    memory first costs its pages twice. The file is named by the save, so no one else writes or reads it
    before the commit."""
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, "wb") as f:
        built = ocdbt_tree.build_tree(entries, spill=f.write, **tree)
        f.write(built.nodes)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    if sync:
        fsync_dir(os.path.dirname(full))
    return built, _Written()


# --- readers ------------------------------------------------------------------------


class BTreeIndex:
    """A packed checkpoint's B+tree as a reader walks it: only the nodes on the way to the keys it asks for.

    ``root`` is the root node's span (``data_files.index``); every other node
    lies before it in the same file, and is read when a lookup first needs it,
    level by level, all the nodes a level needs in one call of ``read``: so a
    rank that loads its own shards reads the leaves holding its keys, never the
    whole tree, and a file of at most ``whole_up_to`` bytes is read at once.
    ``files``: the data files the root document lists; a value stored in any
    other file (a path the index was made to name, outside the checkpoint or
    not) is refused.
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

    def get(self, key: str) -> bytes | ocdbt.Ref | None:
        if key not in self.values:
            self.lookup((key,))
        return self.values[key]

    def lookup(self, keys: Iterable[str]) -> None:
        """Find every key of ``keys`` not looked up before, reading the nodes on their paths."""
        wanted = sorted({k.encode("utf-8", "surrogateescape") for k in keys if k not in self.values})
        if wanted:
            self._descend(wanted)

    def everything(self) -> dict[str, bytes | ocdbt.Ref]:
        """Every key of the tree and its value, reading every node (``verify``): each node checked as a lookup
        checks it."""
        return self._descend(None)

    def _descend(self, wanted: list[bytes] | None) -> dict[str, bytes | ocdbt.Ref]:
        """Walk down from the root, level by level, the nodes a level needs read at once: to the leaves holding
        ``wanted`` (sorted), or to every leaf (None). Records what it found in :attr:`values` (None for a wanted
        key the tree lacks) and returns the keys it found with their values."""
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
