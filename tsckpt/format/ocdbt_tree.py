"""A B+tree of OCDBT nodes built from sorted entries: leaves cut by size, then interior levels up to one root.

The coordinator of a packed save knows every key and where its value is
(:class:`~tsckpt.format.ocdbt.Entries`), so it writes the whole tree in one
pass, its nodes back to back in one file, where TensorStore's own writer
inserts keys through transactions. How each node is encoded is
:mod:`tsckpt.format.ocdbt`; this module decides only where the tree is cut
into nodes. Pure functions of bytes; no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .ocdbt import MAX_NODE_ARITY, Entries, Ref, Stats, encode_interior, encode_leaf_columns


@dataclass(frozen=True)
class Tree:
    """A B+tree encoded into one node file: its bytes, and the root the manifest points to."""

    nodes: bytes
    root: Ref
    height: int
    stats: Stats


def build_tree(keys: Sequence[bytes] | Entries, values: Sequence[bytes | Ref] | None = None, path: str = "",
               max_node_bytes: int = 8 << 20, start: int = 0) -> Tree:
    """Every leaf, then every level of interior nodes up to the root, back to back in node file ``path``.

    ``keys`` must be sorted and distinct (or :class:`Entries`, with ``values``
    None); leaves and interior nodes are cut to stay under ``max_node_bytes``
    (estimated from the keys and inline values before encoding) and
    :data:`MAX_NODE_ARITY` entries. ``start``: where the nodes begin in the
    file (after values stored there first).
    """
    entries = keys if isinstance(keys, Entries) else Entries.of(keys, values or [])
    if not entries.keys:
        raise ValueError("an OCDBT tree of no keys has no root node")
    sizes = np.fromiter((len(k) for k in entries.keys), dtype=np.int64, count=len(entries.keys)) + 24
    inline = np.flatnonzero(entries.file < 0)
    sizes[inline] += np.asarray([len(entries.inline[k] or b"") for k in inline.tolist()], dtype=np.int64)
    out = bytearray()
    level: list[tuple[bytes, Ref, Stats]] = []
    for lo, hi in _cuts(sizes.tolist(), max_node_bytes):
        node, stats = encode_leaf_columns(entries, lo, hi)
        level.append((entries.keys[lo], Ref(path, start + len(out), len(node)), stats))
        out += node
    height = 0
    while len(level) > 1:
        height += 1
        upper = []
        for lo, hi in _cuts([len(k) + 40 for k, _, _ in level], max_node_bytes, least=2):
            part = level[lo:hi]
            node, stats = encode_interior(height, [k for k, _, _ in part], [r for _, r, _ in part],
                                          [s for _, _, s in part])
            upper.append((part[0][0], Ref(path, start + len(out), len(node)), stats))
            out += node
        level = upper
    _, root, stats = level[0]
    return Tree(bytes(out), root, height, stats)


def _cuts(sizes: Sequence[int], limit: int, least: int = 1) -> list[tuple[int, int]]:
    """Consecutive ``[lo, hi)`` runs of entries whose estimated sizes stay under ``limit``, each of at least
    ``least`` entries (interior levels take two, so the tree narrows to one root)."""
    runs, lo, total = [], 0, 64
    for k, size in enumerate(sizes):
        if k - lo >= least and (total + size > limit or k - lo >= MAX_NODE_ARITY):
            runs.append((lo, k))
            lo, total = k, 64
        total += size
    runs.append((lo, len(sizes)))
    return runs
