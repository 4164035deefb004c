"""The commit protocol: how a save begins and becomes a visible checkpoint, and how loads check it.

:func:`begin_save` (coordinator, before any data) chooses the save's target, which refuses what it must and
removes dead saves' leftovers; :func:`commit_checkpoint`, once every rank's data is durable, writes the array
and group nodes and last the root ``zarr.json`` holding the metadata document: that single write is the commit
(``docs/publication.md``).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Mapping, Sequence
from typing import Any

import tensorstore as ts

from .. import __version__
from ..errors import (ChecksumError, CheckpointNotFoundError, IncompleteCheckpointError, MetadataError,
                      NotACheckpointError)
from ..storage.context import DEFAULT_IO_CONCURRENCY
from ..storage.location import Location, LocationLike, parse_location
from ..storage.kvio import encode_json, list_keys, read_json
from ..format import checksums, dtypes, object_values, ocdbt, zarr_json
from ..format.data_files import DataFiles, RankFiles, Span
from ..format.metadata import MAX_DOCUMENT_BYTES, ArrayOptions, CheckpointMetadata, Mesh, ObjectEntry, TensorEntry
from ..format.names import parent_groups
from ..format.reuse import Reuse
from ..storage.store import Store
from .in_place import InPlaceTarget
from .staged import StagedTarget
from .staging_dirs import hint
from .states import ATTRIBUTE, FOREIGN, ROOT, is_data_file, without_root
from .target import Leftover, SaveTarget

CHECKSUM_ATTRIBUTE = "tsckpt_crc32c"


def target_kind(location: Location) -> type[SaveTarget]:
    """The kind of target for a location: staged where renames exist (local files), in place elsewhere."""
    return StagedTarget if location.driver == "file" else InPlaceTarget


def begin_save(location: LocationLike, *, save_id: str, overwrite: bool,
               writes: tuple[str, ...] = ()) -> SaveTarget:
    """Start a save into ``location``: checks, fencing and leftover removal; returns its target. ``writes``: the
    key prefixes its ranks will write, where known before planning (:meth:`.SaveTarget.record_writes`)."""
    loc = parse_location(location)
    target = target_kind(loc)(loc, save_id, overwrite)
    target.written = tuple(writes)
    target.begin()
    return target


def leftovers(location: LocationLike) -> list[Leftover]:
    """Leftovers of saves into ``location`` that did not finish (running saves' data included, marked live)."""
    loc = parse_location(location)
    return target_kind(loc).leftovers(loc)


def clean(location: LocationLike, *, force: bool = False) -> list[Leftover]:
    """Remove leftovers of dead saves into ``location``; returns what was removed.

    Without ``force`` only what is known to be dead goes (staging directories whose save's lock is free, after
    finishing a publication that died half-way). ``force`` also removes what cannot be told from a running save:
    claims on object stores (with a dead save's data where nothing is committed), and staging directories on
    filesystems without locks. A committed checkpoint is never touched.
    """
    loc = parse_location(location)
    return target_kind(loc).clean(loc, force=force)


def commit_checkpoint(store: Store, *, save_id: str, world_size: int, tensors: Mapping[str, TensorEntry],
                      objects: Mapping[str, ObjectEntry], blob_sizes: Mapping[str, int], ranks: Sequence[RankFiles],
                      stored: ocdbt.Entries | None = None, meshes: Sequence[Mesh] = (),
                      extra: Mapping[str, Any] | None = None, options: ArrayOptions = ArrayOptions(),
                      target: SaveTarget | None = None, content_hash: str | None = None,
                      reuse: Reuse | None = None) -> CheckpointMetadata:
    """Validate the entries, write every node, assemble the metadata document and commit it; call once all
    data is durable.

    ``blob_sizes``: the byte count of every ``torch``-encoded value's blob; ``options``: the codecs the chunks
    were written with; ``ranks``: what each rank stored besides chunk keys (its data files, its digest table);
    ``stored``: where every chunk and blob value is, sorted by key, for layouts that index them (packed).
    ``target`` (from :func:`begin_save`) writes and publishes the root document, and drops the save's data if
    the commit fails; without one the root is written to ``store`` directly. ``content_hash``: the algorithm
    of the ranks' digest tables; ``reuse``: what an incremental save took from its base.
    """
    import torch  # only for its version string; every caller has it loaded already

    docs: dict[str, dict[str, Any]] = {}
    for fqn, entry in tensors.items():
        entry.validate(f"tensor {fqn!r}")
        # What each array says about itself in torch terms, for zarr-python users (readers use the root).
        docs[entry.path] = entry.zarr_json(options, {ATTRIBUTE: {
            "kind": "tensor", "key": fqn, "torch_dtype": f"torch.{dtypes.from_zarr(entry.dtype).torch}",
            "placement": entry.placement.to_dict() if entry.placement else None}})
    for fqn, size in blob_sizes.items():
        path = objects[fqn].path
        assert path is not None
        docs[path] = zarr_json.blob_metadata(size, {ATTRIBUTE: {"kind": "object", "key": fqn,
                                                                "encoding": object_values.TORCH}})
    md = CheckpointMetadata(
        world_size=world_size, tensors=dict(tensors), objects=dict(objects), meshes=tuple(meshes),
        torch_version=torch.__version__, tsckpt_version=__version__,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        extra=dict(extra or {}), array_options=options, layout=store.layout.name, content_hash=content_hash,
        reuse=reuse,
        # Where the index will be is known once it is written: a stand-in of the same shape until then.
        data_files=DataFiles(Span("", 0, 0) if store.layout.name == "packed" else None, tuple(ranks)))
    try:
        commit(store, save_id, md, docs, stored, target=target)
    except BaseException:
        if target is not None:
            target.abort()
        raise
    return md


def commit(store: Store, save_id: str, md: CheckpointMetadata, array_docs: dict[str, dict[str, Any]],
           stored: ocdbt.Entries | None, target: SaveTarget | None = None) -> CheckpointMetadata:
    """Write array and group nodes (and the layout's index), made durable unless the store does not sync, then
    the root document (the commit point); returns the metadata as committed. ``target`` fences the location
    before a node another save could write is written (:meth:`.SaveTarget.begin_commit`), and writes the root
    and publishes it; without one the root is written to ``store`` directly."""
    document = md.to_dict()
    _check_size(document, md, target)
    groups = [g for g in parent_groups(list(array_docs)) if g]
    docs = {f"{path}/{ROOT}": encode_json(doc) for path, doc in array_docs.items()}
    docs |= {f"{g}/{ROOT}": encode_json(zarr_json.group_metadata()) for g in groups}
    index, flush = store.layout.write_nodes(store, save_id, docs, stored,
                                            target.begin_commit if target is not None else lambda: None)
    if flush is not None and store.sync:
        flush()
    if md.data_files is not None:
        md = dataclasses.replace(md, data_files=dataclasses.replace(md.data_files, index=index))
        document["data_files"] = md.data_files.to_dict()
    root = encode_json(zarr_json.group_metadata({ATTRIBUTE: document, CHECKSUM_ATTRIBUTE: document_checksum(document)}))
    if target is None:
        store.kvstore.write(ROOT, root).result()
    else:
        target.commit_root(store.kvstore, root)
    return md


#: What the root adds to its document, with room to spare: the group node around it, the checksum, and the
#: digits the packed index's place takes once it is known (the document is checked with a stand-in).
_ROOT_OVERHEAD = 512


def _check_size(document: dict[str, Any], md: CheckpointMetadata, target: SaveTarget | None) -> None:
    """Refuse, before any node is written, a root that no reader would accept: it must never become the commit."""
    size = len(encode_json(document)) + _ROOT_OVERHEAD
    if size > MAX_DOCUMENT_BYTES:
        raise MetadataError(f"{target.url if target is not None else 'the checkpoint'}: its root {ROOT} would be "
                            f"about {size} bytes, more than the {MAX_DOCUMENT_BYTES} a reader accepts "
                            f"({len(md.tensors)} tensors, {len(md.objects)} values, {md.world_size} ranks); "
                            f"nothing was committed")


def document_checksum(document: Mapping[str, Any]) -> int:
    """crc32c of the metadata document's canonical JSON (sorted keys, no spaces): stored beside the document, so
    a damaged root that still parses (a flipped digit in a shape) is refused instead of trusted."""
    canonical = json.dumps(document, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return checksums.crc32c(canonical.encode("utf-8"))


#: What a DCP ``FileSystemWriter`` checkpoint holds: a pickled ``.metadata`` and ``*.distcp`` files.
DCP_METADATA, DCP_SUFFIX = b".metadata", b".distcp"


def read_metadata(kv: ts.KvStore, url: str) -> CheckpointMetadata:
    """The committed metadata, or a clear error saying why there is none."""
    try:
        doc = read_json(kv, ROOT, where=url, max_bytes=MAX_DOCUMENT_BYTES)
    except (ValueError, RecursionError) as e:
        # ValueError covers bad JSON and bytes that are not UTF-8; absurd nesting exhausts the recursion instead.
        raise MetadataError(f"{url}/{ROOT} is not valid JSON: {e}") from None
    attrs = doc.get("attributes") if isinstance(doc, dict) else None
    if not isinstance(attrs, dict) or ATTRIBUTE not in attrs:
        keys = list_keys(kv, url) if doc is None else [ROOT.encode()]
        if not keys:
            raise CheckpointNotFoundError(f"no checkpoint at {url}: the location is empty or missing"
                                          + _leftover_hint(kv))
        if DCP_METADATA in keys and any(k.endswith(DCP_SUFFIX) for k in keys):
            raise NotACheckpointError(
                f"{url} is a DCP FileSystemWriter checkpoint, not a tsckpt one; convert it with "
                f"`tsckpt convert --trust-pickle {url} DST` (its .metadata is a pickle: trust it first)")
        found = without_root([k.decode("utf-8", "replace") for k in keys]) if doc is None else None
        if found is not None and found.state == FOREIGN and not _written_by_tsckpt(kv, keys):
            # Not a save that died, but something else (or a directory of them).
            raise NotACheckpointError(f"no checkpoint at {url}: it holds {found.what}, and no committed "
                                      f"metadata in {ROOT}")
        raise IncompleteCheckpointError(f"{url} is an incomplete checkpoint: the save did not finish "
                                        f"(no committed metadata in {ROOT}); it cannot be loaded")
    document = attrs[ATTRIBUTE]
    stored = attrs.get(CHECKSUM_ATTRIBUTE)
    version = document.get("version") if isinstance(document, dict) else None
    if stored is not None or (isinstance(version, int) and version >= 2):
        try:
            actual = document_checksum(document)
        except (TypeError, ValueError, RecursionError) as e:
            raise MetadataError(f"{url}/{ROOT}: malformed checkpoint metadata ({e})") from None
        if stored != actual:
            raise ChecksumError(f"{url}/{ROOT}: the metadata document does not match its crc32c "
                                f"({stored!r} stored, {actual} computed): the file is damaged")
    try:
        return CheckpointMetadata.from_dict(document)
    except MetadataError as e:
        raise type(e)(f"{url}/{ROOT}: {e}") from None
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError, RecursionError) as e:
        # A hostile document reaching a case from_dict's checks did not foresee must still be a clean refusal.
        raise MetadataError(f"{url}/{ROOT}: malformed checkpoint metadata ({type(e).__name__}: {e})") from None


def _written_by_tsckpt(kv: ts.KvStore, keys: list[bytes]) -> bool:
    """Whether an array document among ``keys`` says tsckpt wrote it (a few are read): evidence enough to call the
    location an incomplete checkpoint when loading, never to delete anything."""
    if any(is_data_file(k.decode("utf-8", "replace")) for k in keys):
        return True  # a save's data files (format version 4) are named after it
    nodes = [k for k in keys if k.endswith(b"/" + ROOT.encode())]
    for node in sorted(nodes, key=lambda k: -k.count(b"/"))[:4]:  # the deepest are arrays
        try:
            doc = read_json(kv, node.decode("utf-8", "replace"))
        except (ValueError, RecursionError):
            continue
        attrs = doc.get("attributes") if isinstance(doc, dict) else None
        if isinstance(attrs, dict) and ATTRIBUTE in attrs:
            return True
    return False


def _leftover_hint(kv: ts.KvStore) -> str:
    """For a missing local checkpoint: staging directories of saves into it that did not finish."""
    spec = kv.spec().to_json()
    return "" if spec.get("driver") != "file" else hint(str(spec.get("path", "")).rstrip("/"))


def open_committed(location: LocationLike, *,
                   io_concurrency: int = DEFAULT_IO_CONCURRENCY) -> tuple[Store, CheckpointMetadata]:
    """Open a committed checkpoint for reading: its metadata, and a store using the checkpoint's layout."""
    store = Store.open(location, io_concurrency=io_concurrency)
    md = read_metadata(store.kvstore, store.url)
    return store.for_checkpoint(md), md
