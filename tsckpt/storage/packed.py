"""The packed layout: every chunk of a checkpoint in a few large files, through TensorStore's OCDBT kvstore.

Each global tensor is still one Zarr v3 array with the same chunk grid; only
where its keys live changes. A packed checkpoint at ``BASE`` holds::

    zarr.json                         root group and metadata document, a plain file written last (the commit)
    manifest.ocdbt, d/<32 hex>        the joined OCDBT database: every array's and group's zarr.json,
                                      and a B+tree mapping each chunk key to bytes in the ranks' data files
    ocdbt.process_<r>/d/<32 hex>      the data files of rank r's own OCDBT database (its manifest
                                      is deleted once joined), each about ``target_data_file_size``

Saving: every rank writes its chunks into its own database, so no two
processes ever write one database and no locking or coordination service is
needed. At commit the coordinator copies each rank's B+tree into the root
database with ``experimental_copy_range_to``, which records references to the
ranks' data files instead of copying bytes, then writes the array and group
documents into it, then the root ``zarr.json`` as a plain file beside
``manifest.ocdbt``. The root document stays outside the database so the commit
is still one atomic write of one file (TensorStore 0.1.86 refuses the copy
inside an atomic transaction, so the join itself cannot be the commit), and a
location without it is an incomplete checkpoint exactly as in the plain layout.

Reading: an array is the ``zarr3`` driver over ``{"driver": "ocdbt", "base": BASE}``
with the array's path; :func:`tsckpt.zarr_store` (``tsckpt/read/zarr_kvstore.py``)
serves the same keys to zarr-python.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import tensorstore as ts

from ..errors import OptionError, StorageError
from .kvio import kv_name, problem, storage_error
from .location import Location
from . import packed_reuse
from .packed_reuse import KeptChunks

#: Rank ``r`` writes its database under ``ocdbt.process_<r>/`` (the name Orbax uses).
PROCESS_PREFIX = "ocdbt.process_"
#: The joined database's manifest, at the checkpoint's root.
MANIFEST = "manifest.ocdbt"
#: Where OCDBT puts a database's data files, relative to the database.
DATA_PREFIX = "d/"
#: Context resource holding decoded B+tree nodes for readers (see :func:`reader_context`).
NODE_CACHE = "cache_pool#tsckpt_ocdbt"
NODE_CACHE_BYTES = 64 << 20
#: Object-store reads of values stored one after the other (inner chunks of one outer
#: chunk, the chunks of one rank), or at most 4 KiB apart (as TensorStore's S3 driver
#: merges a batch), are merged into one request. Not further: merging across larger gaps
#: (Orbax merges up to 1 MiB apart) fetches the inner chunks a resharded load skips. On a
#: 4 -> 4 column reshard from moto (benchmarks/fetched.py, 57 MB): 1.10x the bytes needed
#: in 2090 requests at 4 KiB; 1.31x in 606 at 16 KiB; 1.32x in 557 at 64 KiB; 3.8x in 145 at 1 MiB.
_REMOTE_DRIVERS = frozenset({"s3", "gcs", "http"})
_READ_COALESCING = {
    "experimental_read_coalescing_threshold_bytes": 4096,
    "experimental_read_coalescing_merged_bytes": 1 << 30,
    "experimental_read_coalescing_interval": "1ms",
}


@dataclass(frozen=True)
class PackedOptions:
    """How the OCDBT databases of a packed checkpoint are written.

    Attributes:
        target_data_file_size: about how many bytes of chunks each data file
            holds. A rank commits its writes every this many bytes (one OCDBT
            commit, so one data file holding the chunks and their B+tree nodes),
            and holds at most two such batches in memory at once. The database's
            own file limit is twice this, so a batch is never split unless one
            write alone is larger. 0 means one file per rank. 256 MiB: a rank's
            files stay few (1 + bytes / 256 MiB).
        max_inline_value_bytes: values up to this size (``zarr.json`` documents,
            0-d tensors, tiny chunks) are stored inside B+tree nodes instead of
            data files.
        max_decoded_node_bytes: largest B+tree node before decompression;
            large nodes keep the tree shallow (one or two reads per lookup).
        compress_nodes: zstd-compress B+tree nodes (chunk data is never
            recompressed: that is the arrays' codecs' job).
    """

    target_data_file_size: int = 256 << 20
    max_inline_value_bytes: int = 1024
    max_decoded_node_bytes: int = 8 << 20
    compress_nodes: bool = True

    def __post_init__(self) -> None:
        for name in ("target_data_file_size", "max_inline_value_bytes", "max_decoded_node_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise OptionError(f"packed layout option {name} must be an integer >= 0, not {value!r}")
        if self.max_inline_value_bytes > 1 << 20:
            raise OptionError(f"packed layout option max_inline_value_bytes must be at most 1 MiB, "
                              f"not {self.max_inline_value_bytes}")
        if self.max_decoded_node_bytes < 4096:
            raise OptionError(f"packed layout option max_decoded_node_bytes must be at least 4096, "
                              f"not {self.max_decoded_node_bytes}")

    def ocdbt_config(self) -> dict[str, Any]:
        """The OCDBT ``config`` member: fixed when a database is created, checked when it is reopened."""
        return {
            "max_inline_value_bytes": self.max_inline_value_bytes,
            "max_decoded_node_bytes": self.max_decoded_node_bytes,
            # One writer per database, so the single-file manifest is safe and the cheapest.
            "manifest_kind": "single",
            "compression": {"id": "zstd"} if self.compress_nodes else None,
        }

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> PackedOptions:
        unknown = set(doc) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise OptionError(f"unknown packed layout options {sorted(unknown)}")
        return cls(**doc)


def _prefix(path: str) -> str:
    path = path.strip("/")
    return f"{path}/" if path else ""


def _under(base: Mapping[str, Any], relpath: str) -> dict[str, Any]:
    """The kvstore spec of a sub-directory of ``base`` (an absolute base path stays absolute)."""
    path = str(base.get("path", ""))
    if path and not path.endswith("/"):
        path += "/"
    return {**base, "path": path + _prefix(relpath)}


@dataclass(frozen=True)
class PackedLayout:
    """Where a packed checkpoint's keys live, and the steps a save adds.

    Every method takes the checkpoint's base kvstore spec (a dict such as
    ``{"driver": "file", "path": "/ckpt/"}``, an ``s3`` or ``memory`` spec; no
    ``context`` member) and returns kvstore specs, so the caller keeps building
    its ``zarr3`` specs as for the plain layout.

    A rank must open all of its arrays with one ``ts.Context``, and the
    coordinator must :meth:`join` with one context: TensorStore shares one
    OCDBT writer per database and context, and copies by reference only
    between databases opened through the same base driver.
    """

    name: ClassVar[str] = "packed"
    options: PackedOptions = PackedOptions()

    # --- specs -------------------------------------------------------------

    def rank_database(self, base: Mapping[str, Any], rank: int) -> dict[str, Any]:
        """The OCDBT kvstore spec of rank ``rank``'s own database (for writing)."""
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise OptionError(f"rank must be an integer >= 0, not {rank!r}")
        return self._writable(_under(base, f"{PROCESS_PREFIX}{rank}"))

    def root_database(self, base: Mapping[str, Any], *, writable: bool = False) -> dict[str, Any]:
        """The OCDBT kvstore spec of the joined database at the checkpoint's root.

        Writable for the coordinator's join and node documents; otherwise the
        reader's spec: its configuration comes from the manifest, decoded
        B+tree nodes are cached in :data:`NODE_CACHE`, and on object stores
        nearby reads are coalesced.
        """
        root = _under(base, "")
        if writable:
            return self._writable(root)
        spec: dict[str, Any] = {"driver": "ocdbt", "base": root, "cache_pool": NODE_CACHE}
        if root.get("driver") in _REMOTE_DRIVERS:
            spec |= _READ_COALESCING
        return spec

    def write_kvstore(self, base: Mapping[str, Any], rank: int, path: str) -> dict[str, Any]:
        """Where rank ``rank`` writes the chunks of the array at ``path``."""
        return {**self.rank_database(base, rank), "path": _prefix(path)}

    def rank_transaction(self) -> ts.Transaction:
        """A transaction for one batch of a rank's writes (see :mod:`tsckpt.storage.batch`).

        One atomic transaction makes the batch one OCDBT commit: one manifest
        write and one data file, instead of a commit (and a small data file)
        each time TensorStore happens to flush. The source arrays stay
        referenced, not copied, until the commit (write with
        ``can_reference_source_data_indefinitely``).
        """
        return ts.Transaction(atomic=True)

    def read_kvstore(self, base: Mapping[str, Any], path: str) -> dict[str, Any]:
        """Where readers find the array (or group) at ``path`` of a joined checkpoint."""
        return {**self.root_database(base), "path": _prefix(path)}

    def _writable(self, base: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "driver": "ocdbt",
            "base": dict(base),
            "config": self.options.ocdbt_config(),
            # Nobody else writes this database: skip writing an empty manifest
            # first just to agree on the configuration.
            "assume_config": True,
            # A batch of target_data_file_size bytes plus its B+tree nodes stays one file.
            "target_data_file_size": 2 * self.options.target_data_file_size,
        }

    # --- the coordinator's step ------------------------------------------

    def join(self, base: Mapping[str, Any], world_size: int, context: ts.Context,
             kept: KeptChunks | None = None) -> tuple[ts.KvStore, Callable[[], None]]:
        """Join ranks ``0 .. world_size-1``'s databases into the root database, by reference.

        Returns ``(nodes, flush)``, the ``nodes`` argument of
        :func:`tsckpt.commit.protocol.commit`: write every array's and group's
        ``zarr.json`` into ``nodes``, then call ``flush``, which commits the
        copies and the documents to the root database in one batch (one
        manifest, about one data file of B+tree nodes), returns once they are
        durable, and deletes the ranks' manifests, which nothing reads any
        more. Only after it may the root ``zarr.json`` be written.

        The copies and documents go through one non-atomic transaction so
        TensorStore commits them together; the commit of the checkpoint is
        still the root document, so nothing depends on this batch being
        atomic. A rank that wrote nothing has no database and adds nothing.

        ``kept``: chunks of an incremental save's base that the new database
        keeps; the root database then starts as a linked copy of the base's
        (:mod:`tsckpt.storage.packed_reuse`), local filesystems only.
        """
        where = _describe(base)
        txn = ts.Transaction(atomic=False)
        linked = packed_reuse.mirror(kept.path, str(base["path"]).rstrip("/")) if kept is not None else []
        try:
            root = ts.KvStore.open(self.root_database(base, writable=True), context=context).result()
            if kept is not None:
                packed_reuse.keep_only(root, kept.keys, where)
            nodes = root.with_transaction(txn)
            ranks = [ts.KvStore.open(self.rank_database(base, r), context=context) for r in range(world_size)]
            copies = [(r, db.result().experimental_copy_range_to(nodes)) for r, db in enumerate(ranks)]
        except ValueError as e:
            raise storage_error(e, f"cannot open the packed databases at {where}") from None
        for rank, copy in copies:
            try:
                copy.result()
            except ValueError as e:
                raise StorageError(f"joining rank {rank}'s database {PROCESS_PREFIX}{rank}/ into the "
                                   f"checkpoint at {where} failed: {problem(e)}") from None

        def flush() -> None:
            try:
                txn.commit_async().result()
                # The joined database refers to the ranks' data files, never to
                # their manifests: dropping those leaves one file per rank and
                # target size. A coordinator dying here only leaves them behind.
                plain = ts.KvStore.open(_under(base, ""), context=context).result()
                for f in [plain.delete_range(_single_key(f"{PROCESS_PREFIX}{r}/{MANIFEST}"))
                          for r in range(world_size)]:
                    f.result()
                if linked:
                    packed_reuse.drop_unreferenced(str(base["path"]).rstrip("/"), linked, context)
            except ValueError as e:
                raise storage_error(e, f"committing the joined database of {where} failed") from None

        return nodes, flush


def reader_context(parent: ts.Context, cache_bytes: int = NODE_CACHE_BYTES) -> ts.Context:
    """A child of ``parent`` that defines :data:`NODE_CACHE`, which reader specs refer to.

    Make it once per reader and open every array with it: the decoded B+tree
    nodes are then read once, not once per chunk.
    """
    return ts.Context({NODE_CACHE: {"total_bytes_limit": cache_bytes}}, parent=parent)


def is_packed(kv: ts.KvStore) -> bool:
    """Whether the location behind the plain kvstore ``kv`` holds a joined OCDBT database.

    A plain checkpoint never has a key named ``manifest.ocdbt`` at its root
    (array paths hold directories, never a bare file of that name).
    """
    try:
        return kv.read(MANIFEST, byte_range=slice(0, 0)).result().state == "value"
    except ValueError as e:
        raise storage_error(e, f"cannot read {MANIFEST} at {kv_name(kv)}") from None


def prefix_range(prefix: str) -> ts.KvStore.KeyRange:
    """The range of keys starting with ``prefix`` (every key when it is empty)."""
    if not prefix:
        return ts.KvStore.KeyRange()
    # UTF-8 keeps code point order, so bumping the last character bounds every key under the prefix.
    return ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1))


def _single_key(key: str) -> ts.KvStore.KeyRange:
    return ts.KvStore.KeyRange(key, key + "\0")


def _describe(base: Mapping[str, Any]) -> str:
    return Location(dict(base)).url
