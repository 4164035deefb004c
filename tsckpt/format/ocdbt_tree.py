"""A B+tree of OCDBT nodes built from sorted entries: leaves cut by size, then interior levels up to one root.

The coordinator of a packed save knows every key and where its value is
(:class:`~tsckpt.format.ocdbt.Entries`), so it writes the whole tree in one
pass, its nodes back to back in one file, where TensorStore's own writer
inserts keys through transactions. How each node is encoded is
:mod:`tsckpt.format.ocdbt_leaves` (leaves) and :mod:`tsckpt.format.ocdbt`
(interior nodes); this module decides only where the tree is cut into nodes. Pure functions of bytes; no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .ocdbt import Entries, Ref, Stats, interior_nodes
from .ocdbt_leaves import cut, leaves


@dataclass(frozen=True)
class Tree:
    """A B+tree encoded into one node file: its bytes (those not yet handed to :func:`build_tree`'s ``spill``:
    all of them without it), and the root the manifest points to."""

    nodes: bytes | bytearray
    root: Ref
    height: int
    stats: Stats


def build_tree(entries: Entries, path: str = "", max_node_bytes: int = 8 << 20, head: bytes = b"",
               spill: Callable[[bytearray], object] | None = None) -> Tree:
    """Every leaf, then every level of interior nodes up to the root, back to back in node file ``path``.

    Leaves and interior nodes are cut to stay under ``max_node_bytes``
    (estimated from the keys and inline values before encoding) and
    :data:`~tsckpt.format.ocdbt.MAX_NODE_ARITY` entries. ``head``: what the
    file holds before the nodes (values stored there), the start of the file.
    ``spill``: given, it is handed the file's bytes in order, a few megabytes
    at a time, and :attr:`Tree.nodes` holds what is left.
    """
    if not len(entries):
        raise ValueError("an OCDBT tree of no keys has no root node")
    # One buffer the nodes are appended to: at scale the file is gigabytes, which a list of nodes joined at the
    # end would hold twice. Spilled, the buffer's pages are reused (a file of gigabytes built in memory, then
    # written, cost twice the new pages).
    out = bytearray(head)
    base = 0  # bytes spilled before out

    def spilled() -> None:
        nonlocal base
        if spill is not None and len(out) >= _SPILL_BYTES:
            spill(out)
            base += len(out)
            del out[:]

    level = _Level()
    for written in leaves(entries, max_node_bytes, out):
        level.extend(written.first, base + written.at, written.length, written.keys, written.held)
        spilled()
    height = 0
    while len(level.first) > 1:
        height += 1
        upper = _Level()
        below = level.columns()
        bounds = cut(np.fromiter(map(len, level.first), np.int64, len(level.first)) + 40, max_node_bytes,
                     least=2).tolist()
        nodes = interior_nodes(height, level.first, [path], np.zeros(len(level.first), np.int64), *below,
                               bounds=bounds)
        _, _, keys, tree_bytes, held = (np.add.reduceat(c, bounds[:-1]).tolist() for c in below)
        for i, (lo, node) in enumerate(zip(bounds[:-1], nodes)):
            upper.add(level.first[lo], base + len(out), len(node), keys[i], tree_bytes[i] + len(node), held[i])
            out += node
            spilled()
        level = upper
    root = Ref(path, level.offset[0], level.length[0])
    return Tree(out, root, height, Stats(level.keys[0], level.tree_bytes[0], level.held[0]))


#: How much of the node file :func:`build_tree` holds before it spills (below glibc's largest mmap threshold,
#: so the buffer's memory is reused, not returned and faulted in again).
_SPILL_BYTES = 16 << 20


class _Level:
    """One level of the tree as it is built, in columns: each node's first key, where it is, and what its
    subtree holds (keys, bytes of nodes, bytes of values in data files)."""

    def __init__(self) -> None:
        self.first: list[bytes] = []
        self.offset: list[int] = []
        self.length: list[int] = []
        self.keys: list[int] = []
        self.tree_bytes: list[int] = []
        self.held: list[int] = []

    def add(self, first: bytes, offset: int, length: int, keys: int, tree_bytes: int, held: int) -> None:
        self.first.append(first)
        self.offset.append(offset)
        self.length.append(length)
        self.keys.append(keys)
        self.tree_bytes.append(tree_bytes)
        self.held.append(held)

    def extend(self, first: list[bytes], at: int, length: list[int], keys: list[int], held: list[int]) -> None:
        """Leaves appended back to back from ``at``: their bytes are their subtrees' bytes of nodes."""
        self.first += first
        self.offset += (at + np.cumsum(length) - length).tolist()
        self.length += length
        self.keys += keys
        self.tree_bytes += length
        self.held += held

    def columns(self) -> list[np.ndarray]:
        """Offsets, lengths, keys, node bytes and value bytes, each as int64."""
        return [np.asarray(c, np.int64) for c in (self.offset, self.length, self.keys, self.tree_bytes, self.held)]
