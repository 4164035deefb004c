"""Storage layouts: where a checkpoint's array keys live under its location, registered by name.

A layout decides only which kvstore holds each array's ``zarr.json`` and chunk
keys; the arrays, their chunk grids and codecs are the same in every layout,
and every spec is still built by :mod:`tsckpt.storage.store`.

* ``"plain"``: each array under its own path below the location, one file (or
  object) per chunk. Any Zarr v3 reader opens it directly.
* ``"packed"``: every key in one OCDBT database whose data files are a few
  large files per rank (:mod:`tsckpt.storage.packed`). Zarr readers open it
  through :func:`tsckpt.zarr_store`.

A new layout subclasses :class:`KvLayout` and is decorated with
:func:`register_layout`; a checkpoint's metadata names its layout and
:func:`layout_for` selects it.

Which method runs where, in a save: :meth:`KvLayout.write_kvstore` and
:meth:`KvLayout.rank_transaction` on every rank while it writes;
:meth:`KvLayout.nodes` once, on the coordinator, after every rank's data is
durable and before the root document is written. :meth:`KvLayout.array_kvstore`
and :meth:`KvLayout.context` on every process that reads.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import tensorstore as ts

from ..errors import MetadataError, OptionError
from .location import Location
from .localfs import unsynced_nodes
from ..format.metadata import CheckpointMetadata
from .kvio import storage_error
from .packed import PROCESS_PREFIX, PackedLayout, reader_context
from .packed_reuse import KeptChunks

if TYPE_CHECKING:
    from .store import Store

PLAIN = "plain"
PACKED = PackedLayout.name
#: Environment variable naming the layout of saves that name none (``plain`` when unset).
LAYOUT_ENV = "TSCKPT_LAYOUT"


class KvLayout(ABC):
    """How a checkpoint's arrays and node documents map onto kvstores under its location."""

    name: ClassVar[str]

    @abstractmethod
    def array_kvstore(self, location: Location, path: str) -> dict[str, Any]:
        """The kvstore spec readers find the array (or group) at ``path`` in."""

    def write_kvstore(self, location: Location, rank: int, path: str) -> dict[str, Any]:
        """The kvstore spec rank ``rank`` writes the chunks of the array at ``path`` into."""
        return self.array_kvstore(location, path)

    def context(self, parent: ts.Context) -> ts.Context:
        """The context every array of a location is opened with (a layout may add resources)."""
        return parent

    @abstractmethod
    def rank_prefixes(self, paths: list[str], world_size: int) -> tuple[str, ...]:
        """The key prefixes ranks write the arrays at ``paths`` under before the commit (what a failed save removes)."""

    def rank_transaction(self) -> ts.Transaction | None:
        """A transaction a rank's writes go through, committed every :attr:`batch_bytes` (None: none)."""
        return None

    #: How many bytes a rank writes through one :meth:`rank_transaction` before committing it.
    batch_bytes: int = 0

    def nodes(self, store: Store, world_size: int,
              kept: KeptChunks | None = None) -> tuple[ts.KvStore, Callable[[], None] | None]:
        """Where the commit writes ``<path>/zarr.json`` documents, and a call that makes them durable.

        ``world_size`` ranks wrote the arrays; ``kept`` names chunks of an
        incremental save's base that the layout must keep (the plain layout's
        ranks linked them already). The flush (if any) runs before the root
        document is written.
        """
        return store.kvstore, None

    def hierarchy(self, store: Store) -> ts.KvStore:
        """The kvstore holding every key of a committed checkpoint but the root document, by full key."""
        return store.kvstore


LAYOUTS: dict[str, KvLayout] = {}


def register_layout(cls: type[KvLayout]) -> type[KvLayout]:
    """Class decorator: make a layout available by its ``name``."""
    LAYOUTS[cls.name] = cls()
    return cls


def get_layout(name: str) -> KvLayout:
    try:
        return LAYOUTS[name]
    except KeyError:
        raise OptionError(f"unknown storage layout {name!r}; expected one of {sorted(LAYOUTS)}") from None


def default_layout() -> str:
    """The layout a save uses when it names none: ``$TSCKPT_LAYOUT``, else ``"plain"``.

    A cluster-wide choice belongs in the job's environment rather than in every
    training script. In a multi-rank save only the coordinator's choice counts:
    it is sent to every rank with the plan.
    """
    name = os.environ.get(LAYOUT_ENV, "").strip() or PLAIN
    if name not in LAYOUTS:
        raise OptionError(f"{LAYOUT_ENV}={name!r}: unknown storage layout; expected one of {sorted(LAYOUTS)}")
    return name


def layout_for(metadata: CheckpointMetadata) -> KvLayout:
    """The layout a committed checkpoint was written with (every version-1 checkpoint is plain)."""
    try:
        return LAYOUTS[metadata.layout]
    except KeyError:
        raise MetadataError(f"checkpoint metadata: unknown storage layout {metadata.layout!r}; "
                            f"expected one of {sorted(LAYOUTS)}") from None


@register_layout
class PlainLayout(KvLayout):
    """Each array under its own path below the location: the Zarr hierarchy as files or objects."""

    name = PLAIN

    def array_kvstore(self, location: Location, path: str) -> dict[str, Any]:
        return location.child(path)

    def rank_prefixes(self, paths: list[str], world_size: int) -> tuple[str, ...]:
        return tuple(f"{p}/" for p in paths)

    def nodes(self, store: Store, world_size: int,
              kept: KeptChunks | None = None) -> tuple[ts.KvStore, Callable[[], None] | None]:
        # On local Linux paths, skip a per-file fsync and flush the filesystem once instead.
        fast = unsynced_nodes(store.location)
        return fast if fast is not None else (store.kvstore, None)


@register_layout
class PackedKvLayout(KvLayout):
    """Every key in one OCDBT database: per-rank databases joined at commit (:mod:`tsckpt.storage.packed`)."""

    name = PACKED

    def __init__(self, packed: PackedLayout = PackedLayout()) -> None:
        self.packed = packed

    @property
    def batch_bytes(self) -> int:  # type: ignore[override]
        return self.packed.options.target_data_file_size

    def array_kvstore(self, location: Location, path: str) -> dict[str, Any]:
        return self.packed.read_kvstore(dict(location.spec), path)

    def write_kvstore(self, location: Location, rank: int, path: str) -> dict[str, Any]:
        return self.packed.write_kvstore(dict(location.spec), rank, path)

    def rank_prefixes(self, paths: list[str], world_size: int) -> tuple[str, ...]:
        return tuple(f"{PROCESS_PREFIX}{r}/" for r in range(world_size))

    def context(self, parent: ts.Context) -> ts.Context:
        return reader_context(parent)

    def rank_transaction(self) -> ts.Transaction | None:
        # One OCDBT commit per batch: data files of about the target size, not one per flush.
        return self.packed.rank_transaction()

    def nodes(self, store: Store, world_size: int,
              kept: KeptChunks | None = None) -> tuple[ts.KvStore, Callable[[], None] | None]:
        return self.packed.join(dict(store.location.spec), world_size, store.context, kept)

    def hierarchy(self, store: Store) -> ts.KvStore:
        try:
            return ts.KvStore.open(self.array_kvstore(store.location, ""), context=store.context).result()
        except ValueError as e:
            raise storage_error(e, f"cannot open the packed database of {store.url}") from None
