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

    nodes: bytes | bytearray
    root: Ref
    height: int
    stats: Stats


def build_tree(entries: Entries, path: str = "", max_node_bytes: int = 8 << 20, head: bytes = b"") -> Tree:
    """Every leaf, then every level of interior nodes up to the root, back to back in node file ``path``.

    Leaves and interior nodes are cut to stay under ``max_node_bytes``
    (estimated from the keys and inline values before encoding) and
    :data:`~tsckpt.format.ocdbt.MAX_NODE_ARITY` entries. ``head``: what the
    file holds before the nodes (values stored there), the start of
    :attr:`Tree.nodes`, which is the whole file.
    """
    if not len(entries):
        raise ValueError("an OCDBT tree of no keys has no root node")
    # One buffer the nodes are appended to: at scale the file is hundreds of megabytes, which a list of nodes
    # joined at the end would hold twice.
    out = bytearray(head)
    level: list[tuple[bytes, Ref, Stats]] = []
    for leaf in leaves(entries, max_node_bytes):
        level.append((leaf.first, Ref(path, len(out), len(leaf.node)), Stats(leaf.keys, len(leaf.node), leaf.held)))
        out += leaf.node
    height = 0
    while len(level) > 1:
        height += 1
        upper = []
        bounds = cut(np.asarray([len(k) + 40 for k, _, _ in level], np.int64), max_node_bytes, least=2).tolist()
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            part = level[lo:hi]
            node, stats = encode_interior(height, [k for k, _, _ in part], [r for _, r, _ in part],
                                          [s for _, _, s in part])
            upper.append((part[0][0], Ref(path, len(out), len(node)), stats))
            out += node
        level = upper
    _, root, stats = level[0]
    return Tree(out, root, height, stats)
