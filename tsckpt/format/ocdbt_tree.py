"""A B+tree of OCDBT nodes built from sorted entries: leaves cut by size, then interior levels up to one root.

The coordinator of a packed save knows every key and where its value is
(:class:`~tsckpt.format.ocdbt.Entries`), so it writes the whole tree in one
pass, its nodes back to back in one file, where TensorStore's own writer
inserts keys through transactions. How each node is encoded is
:mod:`tsckpt.format.ocdbt_leaves` (leaves) and :mod:`tsckpt.format.ocdbt`
(interior nodes); this module decides only where the tree is cut into nodes. Pure functions of bytes; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .ocdbt import Entries, Ref, Stats, encode_interior
from .ocdbt_leaves import cut, leaves


@dataclass(frozen=True)
class Tree:
    """A B+tree encoded into one node file: its bytes, and the root the manifest points to."""

    nodes: bytes
    root: Ref
    height: int
    stats: Stats


def build_tree(entries: Entries, path: str = "", max_node_bytes: int = 8 << 20, start: int = 0) -> Tree:
    """Every leaf, then every level of interior nodes up to the root, back to back in node file ``path``.

    Leaves and interior nodes are cut to stay under ``max_node_bytes``
    (estimated from the keys and inline values before encoding) and
    :data:`~tsckpt.format.ocdbt.MAX_NODE_ARITY` entries. ``start``: where the
    nodes begin in the file (after values stored there first).
    """
    if not len(entries):
        raise ValueError("an OCDBT tree of no keys has no root node")
    out: list[bytes] = []
    at = start
    level: list[tuple[bytes, Ref, Stats]] = []
    for leaf in leaves(entries, max_node_bytes):
        level.append((leaf.first, Ref(path, at, len(leaf.node)), Stats(leaf.keys, len(leaf.node), leaf.held)))
        out.append(leaf.node)
        at += len(leaf.node)
    height = 0
    while len(level) > 1:
        height += 1
        upper = []
        bounds = cut(np.asarray([len(k) + 40 for k, _, _ in level], np.int64), max_node_bytes, least=2).tolist()
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            part = level[lo:hi]
            node, stats = encode_interior(height, [k for k, _, _ in part], [r for _, r, _ in part],
                                          [s for _, _, s in part])
            upper.append((part[0][0], Ref(path, at, len(node)), stats))
            out.append(node)
            at += len(node)
        level = upper
    _, root, stats = level[0]
    return Tree(b"".join(out), root, height, stats)
