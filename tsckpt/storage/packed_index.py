"""The coordinator's step of a packed save: the B+tree over every rank's values, and the manifest pointing at it.

The node file is written before the manifest, both before the root document, which alone commits the
checkpoint (docs/format.md). Readers walk the tree with :class:`~tsckpt.storage.packed.BTreeIndex`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import time
from collections.abc import Callable, Mapping

import numpy as np
import tensorstore as ts

from ..format import ocdbt, ocdbt_keys, ocdbt_tree, zarr_json
from ..format.data_files import Span
from .kvio import storage_error
from .localfs import fsync_dir
from .packed import MANIFEST, NODE_BYTES, StoredValues

#: Largest B+tree node a reader must accept (the manifest's ``max_decoded_node_bytes``).
MAX_NODE_BYTES = 8 << 20
#: Values up to this size are stored in the B+tree leaves (zarr.json documents); larger ones in the node file.
MAX_INLINE_VALUE_BYTES = 64 << 10


def index_file(save_id: str) -> str:
    """The path, relative to the checkpoint, of save ``save_id``'s B+tree node file."""
    return f"d/{save_id}.index"


@functools.lru_cache(maxsize=64)
def grid_tails(grid: tuple[int, ...]) -> tuple[ocdbt_keys.Tails, np.ndarray]:
    """The chunk keys of a grid (``c/i/j``, as the array's ``zarr.json`` names them) in sorted order, and the
    row-major index of each: every array of that grid shares them."""
    return ocdbt_keys.sorted_tails([zarr_json.chunk_key(index).encode()
                                    for index in itertools.product(*map(range, grid))])


def merged_entries(docs: Mapping[str, bytes], values: StoredValues) -> ocdbt.Entries:
    """Node documents (inline) and data-file values in one sorted :class:`~tsckpt.format.ocdbt.Entries`.

    Each array's chunk keys are one run (its path, then its grid's keys in sorted order), which no other key
    falls inside: so runs sorted by their first key are the keys sorted, without a key of its own per chunk.
    Each array's values are gathered straight into key order: no column of the whole index is made twice.
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


def write_index(kv: ts.KvStore, save_id: str, entries: ocdbt.Entries, where: str, fence: Callable[[], None], *,
                local_root: str | None, sync: bool) -> Span | None:
    """Write the B+tree over ``entries`` as node file :func:`index_file` and the manifest pointing at it.

    ``entries``: every key of the checkpoint but the root document, sorted, each with its value inline or its
    place in a data file. ``fence`` runs while the node file, named by the save, is on its way; the manifest,
    at a name every save writes, waits for it. ``local_root``: the checkpoint's directory when it is on a
    local disk, where the node file is written straight into its file (fsynced with ``sync``), not through ``kv``.
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
            tree = ocdbt_tree.build_tree(entries, path=path, max_node_bytes=NODE_BYTES, head=head)
            nodes = kv.write(path, tree.nodes)
        else:
            tree, nodes = _write_file(os.path.join(local_root, path), sync, entries, path, head)
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


def _write_file(full: str, sync: bool, entries: ocdbt.Entries, path: str,
                head: bytes) -> tuple[ocdbt_tree.Tree, _Written]:
    """Build the B+tree of ``entries`` (node file ``path``) straight into file ``full`` as it is encoded:
    TensorStore copies a value twice before it writes it (600 MB of new pages for an index of 300 MB), and a
    whole file built in memory first costs its pages twice. The file is named by the save, so no one else
    writes or reads it before the commit."""
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, "wb") as f:
        built = ocdbt_tree.build_tree(entries, path=path, max_node_bytes=NODE_BYTES, head=head, spill=f.write)
        f.write(built.nodes)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    if sync:
        fsync_dir(os.path.dirname(full))
    return built, _Written()
