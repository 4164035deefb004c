"""TensorStore's OCDBT on-disk format (``kvstore/ocdbt/index.rst`` in TensorStore): the manifest and B+tree
nodes, encoded and decoded. The packed layout writes the database itself, where TensorStore's writer commits
through transactions and copies per-rank B+trees to join them. Written: a ``single`` manifest of one version,
uncompressed nodes, keys stored whole (prefix-coded within each node), data file paths relative to the root;
the decoder refuses anything else (:class:`OcdbtFormatError`). Records are built from
:mod:`tsckpt.format.ocdbt_records`; the tree is cut into nodes by :mod:`tsckpt.format.ocdbt_tree`."""

from __future__ import annotations

import struct
import uuid as _uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

# OcdbtFormatError is re-exported: callers catch every refusal of the format as ocdbt.OcdbtFormatError.
from .ocdbt_keys import SortedKeys
from .ocdbt_records import (OcdbtFormatError, Reader, decode_file_table, encode_file_table,  # noqa: F401
                            VarintColumn, envelope, open_envelope, prefix_lengths, varint)

MANIFEST_MAGIC = 0x0CDB3A2A
BTREE_MAGIC = 0x0CDB20DE
#: The key of the manifest under the database root.
MANIFEST_KEY = "manifest.ocdbt"
#: TensorStore's limit on entries per node.
MAX_NODE_ARITY = 1 << 20


def _read_keys(r: Reader, n: int, interior: bool) -> tuple[list[bytes], list[int]]:
    prefixes = [0] + r.varints(n - 1)
    suffixes = r.varints(n)
    subtree = r.varints(n) if interior else []
    blob = bytes(r.take(sum(suffixes)))
    keys: list[bytes] = []
    prev, at = b"", 0
    for k in range(n):
        if prefixes[k] > len(prev):
            raise r.fail(f"key {k}'s prefix is longer than the key before it")
        key = prev[:prefixes[k]] + blob[at:at + suffixes[k]]
        at += suffixes[k]
        if keys and key <= prev:
            raise r.fail("keys out of order")
        keys.append(key)
        prev = key
    return keys, subtree


@dataclass(frozen=True)
class Ref:
    """Where a value or node is stored: ``length`` bytes at ``offset`` of data file ``path``."""

    path: str
    offset: int
    length: int


@dataclass(frozen=True)
class Stats:
    """What an interior entry or a manifest version says of the subtree below it."""

    num_keys: int
    num_tree_bytes: int
    num_indirect_value_bytes: int


@dataclass
class Entries:
    """Sorted keys and their values, in columns: value ``k`` inline (``inline[k]``, ``file[k]`` -1) or
    ``length[k]`` bytes at ``offset[k]`` of data file ``files[file[k]]``."""

    keys: SortedKeys
    inline: dict[int, bytes]
    file: np.ndarray  # int64
    offset: np.ndarray  # int64
    length: np.ndarray  # int64
    files: list[str]

    def __post_init__(self) -> None:
        n = len(self.keys)
        if not len(self.file) == len(self.offset) == len(self.length) == n:
            raise ValueError(f"{n} keys but {len(self.file)} values")
        if sorted(self.inline) != np.flatnonzero(self.file < 0).tolist():
            raise ValueError("inline values must be exactly those stored in no data file")

    def __len__(self) -> int:
        return len(self.keys)

    def pick(self, runs: Sequence[int]) -> Entries:
        """The entries of the key runs numbered ``runs`` (in order)."""
        starts = self.keys.run_starts
        index = np.concatenate([np.arange(starts[r], starts[r + 1]) for r in runs] or [np.zeros(0, np.int64)])
        # Where each inline value lands, looked up in the (sorted) picked positions: a column of every entry's
        # new position would be gigabytes at scale, where the picked runs are a few documents.
        at = np.searchsorted(index, np.asarray(list(self.inline), np.int64)).tolist()
        inline = {a: v for a, (k, v) in zip(at, self.inline.items()) if a < len(index) and index[a] == k}
        return Entries(SortedKeys([self.keys.runs[r] for r in runs]), inline, self.file[index], self.offset[index],
                       self.length[index], self.files)

    @classmethod
    def of(cls, keys: Sequence[bytes], values: Sequence[bytes | Ref]) -> Entries:
        """Entries of sorted, distinct ``keys``, given their values one by one."""
        files = sorted({v.path for v in values if isinstance(v, Ref)})
        number = {p: i for i, p in enumerate(files)}
        return cls(SortedKeys.of(keys), {k: v for k, v in enumerate(values) if not isinstance(v, Ref)},
                   np.asarray([number[v.path] if isinstance(v, Ref) else -1 for v in values], dtype=np.int64),
                   np.asarray([v.offset if isinstance(v, Ref) else 0 for v in values], dtype=np.int64),
                   np.asarray([v.length if isinstance(v, Ref) else 0 for v in values], dtype=np.int64), files)


def interior_nodes(height: int, keys: Sequence[bytes], files: Sequence[str], file: Sequence[int] | np.ndarray,
                   offset: Sequence[int] | np.ndarray, length: Sequence[int] | np.ndarray,
                   num_keys: Sequence[int] | np.ndarray, tree_bytes: Sequence[int] | np.ndarray,
                   held: Sequence[int] | np.ndarray, bounds: Sequence[int]) -> Iterator[bytes]:
    """The interior nodes at ``height`` (>= 1) of children ``bounds[i]:bounds[i + 1]``, for each ``i``: child ``k``
    holds the keys from ``keys[k]`` on and is ``length[k]`` bytes at ``offset[k]`` of node file ``files[file[k]]``
    (``files`` sorted); its subtree holds ``num_keys[k]`` keys in ``tree_bytes[k]`` bytes of nodes and
    ``held[k]`` bytes of values in data files. The columns of a whole level are encoded once."""
    if not 1 <= height <= 255:
        raise ValueError(f"an interior node's height is 1 to 255, not {height}")
    prefix = prefix_lengths(keys)
    prefixes = VarintColumn(prefix)
    suffix_lengths = VarintColumn(np.fromiter(map(len, keys), np.int64, len(keys)) - prefix)
    columns = [VarintColumn(c) for c in (file, offset, length, num_keys, tree_bytes, held)]
    table = encode_file_table(files)
    at = prefix.tolist()
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        n = hi - lo
        if not 0 < n <= MAX_NODE_ARITY:
            raise ValueError(f"an interior node holds 1 to {MAX_NODE_ARITY} children; got {n}")
        # The node's first key is whole: no prefix, its whole length.
        suffixes = b"".join(k[p:] for k, p in zip(keys[lo + 1:hi], at[lo + 1:hi]))
        yield envelope(BTREE_MAGIC, (bytes([height]), table, varint(n), prefixes.cut(lo + 1, hi),
                                     varint(len(keys[lo])), suffix_lengths.cut(lo + 1, hi), bytes(n), keys[lo],
                                     suffixes, *(c.cut(lo, hi) for c in columns)))


@dataclass(frozen=True)
class Node:
    """A decoded B+tree node: a leaf's keys and values, or an interior node's first keys and children."""

    height: int
    keys: list[bytes]
    #: Leaves: each value, inline bytes or a :class:`Ref`; interior nodes: each child's :class:`Ref`.
    values: list[bytes | Ref]


def decode_node(data: bytes | memoryview, where: str) -> Node:
    """A node as :mod:`~tsckpt.format.ocdbt_leaves` or :func:`interior_nodes` writes it (any uncompressed node)."""
    r = open_envelope(data, BTREE_MAGIC, where)
    height = r.byte()
    files = decode_file_table(r)
    n = r.varint()
    if not 0 < n <= MAX_NODE_ARITY:
        raise r.fail(f"a node of {n} entries")
    keys, subtree = _read_keys(r, n, height > 0)
    if any(subtree):
        raise r.fail("subtree common prefixes, which tsckpt never writes")

    def file(i: int) -> str:
        if i >= len(files):
            raise r.fail(f"data file number {i} of a table of {len(files)}")
        return files[i]

    values: list[bytes | Ref] = []
    if height:
        ids, offsets, lengths = r.varints(n), r.varints(n), r.varints(n)
        r.column(3 * n)  # statistics
        values = [Ref(file(i), o, n_) for i, o, n_ in zip(ids, offsets, lengths)]
    else:
        lengths = r.varints(n)
        kinds = np.frombuffer(r.take(n), dtype=np.uint8)
        if (kinds > 1).any():
            raise r.fail("a value kind other than 0 (inline) or 1 (in a data file)")
        indirect = np.flatnonzero(kinds).tolist()
        ids, offsets = r.varints(len(indirect)), r.varints(len(indirect))
        paths = [file(i) for i in range(len(files))] if indirect else []
        if any(i >= len(paths) for i in ids):
            raise r.fail(f"a data file number beyond a table of {len(files)}")
        refs = {k: Ref(paths[i], o, lengths[k]) for k, i, o in zip(indirect, ids, offsets)}
        values = [refs[k] if kinds[k] else bytes(r.take(lengths[k])) for k in range(n)]
    r.done()
    return Node(height, keys, values)


@dataclass(frozen=True)
class Manifest:
    """A single-file manifest of one version: the database configuration and its B+tree root."""

    uuid: bytes
    root: Ref | None
    root_height: int
    stats: Stats
    commit_time_ns: int
    max_inline_value_bytes: int = 1024
    max_decoded_node_bytes: int = 8 << 20
    version_tree_arity_log2: int = 4

    def encode(self) -> bytes:
        files = [self.root.path] if self.root is not None else []
        config = b"".join((self.uuid, b"\x00", varint(self.max_inline_value_bytes),
                           varint(self.max_decoded_node_bytes), bytes([self.version_tree_arity_log2]), varint(0)))
        root = self.root or Ref("", 0, 0)
        version = b"".join((
            varint(1), varint(1), bytes([self.root_height]), varint(0), varint(root.offset), varint(root.length),
            varint(self.stats.num_keys), varint(self.stats.num_tree_bytes),
            varint(self.stats.num_indirect_value_bytes), struct.pack("<Q", self.commit_time_ns)))
        return envelope(MANIFEST_MAGIC, config + encode_file_table(files) + version + varint(0))

    @classmethod
    def decode(cls, data: bytes | memoryview, where: str) -> Manifest:
        r = open_envelope(data, MANIFEST_MAGIC, where)
        uuid = bytes(r.take(16))
        if r.byte() != 0:
            raise r.fail("a manifest kind other than single, which tsckpt never writes")
        inline, node_bytes, arity = r.varint(), r.varint(), r.byte()
        if r.varint() != 0:
            raise r.fail("compressed nodes, which tsckpt never writes")
        files = decode_file_table(r)
        if r.varint() != 1:
            raise r.fail("a number of versions other than the one tsckpt writes")
        r.varint()  # generation number
        height = r.byte()
        file_id, offset, length = r.varint(), r.varint(), r.varint()
        stats = Stats(r.varint(), r.varint(), r.varint())
        commit = struct.unpack("<Q", r.take(8))[0]
        if r.varint() != 0:
            raise r.fail("version tree nodes, which tsckpt never writes")
        r.done()
        if length and file_id >= len(files):
            raise r.fail(f"root in data file number {file_id} of a table of {len(files)}")
        root = Ref(files[file_id], offset, length) if length else None
        return cls(uuid, root, height, stats, commit, inline, node_bytes, arity)


def new_uuid() -> bytes:
    return _uuid.uuid4().bytes

