"""Where a B+tree of OCDBT nodes is cut: leaves by size, then interior levels up to one root, back to back in one
node file. Leaves are encoded by :mod:`tsckpt.format.ocdbt_leaves`, interior nodes by :mod:`tsckpt.format.ocdbt`."""

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
    """Every leaf, then every level of interior nodes up to the root, back to back in node file ``path``, each
    node estimated under ``max_node_bytes`` and :data:`~tsckpt.format.ocdbt.MAX_NODE_ARITY` entries. ``head``: the
    start of the file, before the nodes. ``spill``: handed the file's bytes in order, a few megabytes at a time;
    :attr:`Tree.nodes` holds what is left."""
    if not len(entries):
        raise ValueError("an OCDBT tree of no keys has no root node")
    # One buffer the nodes are appended to: at scale the file is gigabytes, which a list of nodes joined at the
    # end would hold twice; spilled, the buffer's pages are reused.
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
        nodes = interior_nodes(height, level.first, [path], np.zeros(len(level.first), np.int64), *below, bounds=bounds)
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
        self._columns = (self.first, self.offset, self.length, self.keys, self.tree_bytes, self.held)

    def add(self, first: bytes, offset: int, length: int, keys: int, tree_bytes: int, held: int) -> None:
        for column, value in zip(self._columns, (first, offset, length, keys, tree_bytes, held)):
            column.append(value)

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
