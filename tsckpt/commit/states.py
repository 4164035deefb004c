"""What a location holds, as a save, ``clean`` or the step scan sees it: checkpoint states, own keys, refusals.

Deciding only: the one thing here that writes, :func:`delete_own_keys`, deletes one key at a time and only
keys a tsckpt save writes (``docs/publication.md``, "What a save may replace").
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import tensorstore as ts

from ..errors import CheckpointExistsError, FileInTheWayError, ForeignContentError
from ..storage import kvio
from ..storage.kvio import storage_error

ROOT = "zarr.json"
ATTRIBUTE = "tsckpt"
#: The object that fences a running save on stores without rename; a name no array path can take (escaped
#: node names never start with ".").
CLAIM = ".tsckpt-claim.json"

#: The states a location (or a step entry under a root) can be in. DAMAGED is a root document that is not
#: JSON: the step scan reports it, a save treats it as committed.
ABSENT, INCOMPLETE, COMMITTED, FOREIGN, FILE, DAMAGED = "absent", "incomplete", "committed", "foreign", "file", "damaged"

#: A save's own files (format version 4): ranks' data files and their parts, chunk tables, the packed index.
_DATA_FILE_KEY = re.compile(r"^d/[0-9a-f]{32}(?:\.index|-\d+(?:\.\d+|\.table)?)$")
#: A node document or chunk key (either separator), relative to its array.
_NODE_OR_CHUNK = re.compile(r"(?:zarr\.json|c|c(?:\.\d+)+|c(?:/\d+)+)$")
#: The packed layout's OCDBT manifests and data files, and a save's own files.
_LAYOUT_KEY = re.compile(r"^(?:ocdbt\.process_\d+/)?(?:manifest\.ocdbt|d/[0-9a-f]{32})$|" + _DATA_FILE_KEY.pattern)

#: Keys a tsckpt save writes: node documents and chunk keys, its layout's files, and the claim. A location
#: holding only these and no root is a dead save's leftovers.
OWN_KEYS: list[re.Pattern[str]] = [re.compile(r"(?:^|/)" + _NODE_OR_CHUNK.pattern), _LAYOUT_KEY,
                                   re.compile(re.escape(CLAIM) + "$")]

#: TensorStore's file driver writes ``<key>.__lock`` beside a key while it replaces it.
LOCK_SUFFIX = ".__lock"


def is_data_file(key: str) -> bool:
    """Whether ``key`` is named as a version-4 save names its data files, chunk tables and index."""
    return _DATA_FILE_KEY.match(key) is not None


def is_own_key(key: str) -> bool:
    """Whether a save of tsckpt's (any layout) may have written ``key``, relative to its location."""
    key = key.removesuffix(LOCK_SUFFIX)
    return any(p.search(key) for p in OWN_KEYS)


#: Zarr version 2's metadata files, which no tsckpt save writes.
_ZARR_V2 = re.compile(r"(?:^|/)\.z(?:group|array|attrs|metadata)$")


def is_zarr_key(key: str) -> bool:
    """Whether ``key`` is named as Zarr data (node documents, chunk keys, version 2 metadata) or a save's own
    file; every other key is a file a save writes beside and never touches."""
    return is_own_key(key) or _ZARR_V2.search(key.removesuffix(LOCK_SUFFIX)) is not None


@dataclass(frozen=True)
class Found:
    """What a location holds, as far as saving there is concerned."""

    state: str
    #: What was found, in words, for messages.
    what: str = ""
    #: For a committed checkpoint, the save that wrote it (from ``extra.save_id``).
    save_id: str | None = None
    #: How many files beside it are neither Zarr data nor tsckpt's (a run directory's configs and logs).
    others: int = 0


def claim_fields(raw: bytes) -> dict[str, Any]:
    """What a claim says (:data:`CLAIM`: its ``save_id``...); empty where it is not a JSON object with a save id."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return {}
    return doc if isinstance(doc, dict) and isinstance(doc.get("save_id"), str) else {}


def read_key(kv: ts.KvStore, key: str, url: str) -> ts.KvStore.ReadResult:
    return _result(kv.read(key), f"{url}: cannot read {key!r}")


def read_root(kv: ts.KvStore, url: str) -> tuple[Any, bytes]:
    """The root document's bytes (None when absent) and its storage generation."""
    return Survey(kv, url, listing=False).root()


def describe_root(raw: bytes) -> Found:
    """Classify a location by its root document alone."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        # A damaged checkpoint must be replaced on purpose, like any other.
        return Found(COMMITTED, f"a {ROOT} that is not valid JSON (a damaged checkpoint?)")
    attrs = doc.get("attributes") if isinstance(doc, dict) else None
    if isinstance(attrs, dict) and ATTRIBUTE in attrs:
        md = attrs[ATTRIBUTE]
        extra = md.get("extra") if isinstance(md, dict) else None
        save_id = extra.get("save_id") if isinstance(extra, dict) else None
        created = md.get("created") if isinstance(md, dict) else None
        return Found(COMMITTED, f"a tsckpt checkpoint (save {save_id}, created {created})",
                     save_id=save_id if isinstance(save_id, str) else None)
    if isinstance(doc, dict) and doc.get("zarr_format") in (2, 3):
        node = doc.get("node_type", "node")
        return Found(FOREIGN, f"a Zarr {node} that tsckpt did not write (its {ROOT} has no '{ATTRIBUTE}' attributes)")
    return Found(FOREIGN, f"a {ROOT} that is not a Zarr document")


def list_keys(kv: ts.KvStore, url: str) -> list[str]:
    return [k.decode("utf-8", "replace") for k in kvio.list_keys(kv, url)]


def without_root(keys: list[str]) -> Found:
    """Classify a location whose root document is missing by its keys (relative to it); keys named as a save's
    are its leftovers only under its claim (see :func:`beside_others`)."""
    foreign = sorted(k for k in keys if not is_own_key(k))
    if foreign:
        return Found(FOREIGN, f"{len(foreign)} file(s) tsckpt did not write, e.g. {foreign[0]!r}")
    return beside_others(keys)  # every key is named as a save's own: none is beside


def checkpoint_keys(raw: bytes) -> Callable[[str], bool] | None:
    """For a committed root document: which keys belong to that checkpoint (None if it names no arrays): node
    documents and chunk keys of the arrays and groups its metadata names, its layout's keys and the claim (an
    array someone added inside a checkpoint is not)."""
    try:
        md = json.loads(raw)["attributes"][ATTRIBUTE]
        paths = {e["path"] for table in ("tensors", "objects") for e in md[table].values()
                 if isinstance(e, dict) and isinstance(e.get("path"), str)}
    except (ValueError, RecursionError, KeyError, TypeError, AttributeError):
        return None
    groups = {"/".join(p.split("/")[:i]) for p in paths for i in range(1, p.count("/") + 1)}

    def own(key: str) -> bool:
        key = key.removesuffix(LOCK_SUFFIX)
        if key in (ROOT, CLAIM) or _LAYOUT_KEY.match(key):
            return True
        head, sep, tail = key.rpartition("/")
        if tail == ROOT and head in groups:
            return True
        while sep:  # the array path is some prefix of the key; chunk keys may hold "/" themselves
            if head in paths and _NODE_OR_CHUNK.match(key[len(head) + 1:]):
                return True
            head, sep, _ = head.rpartition("/")
        return False

    return own


def beside_others(keys: list[str]) -> Found:
    """Classify a location whose root document is missing, as a save into it sees its keys (relative to it).

    Files that are not Zarr data (:func:`is_zarr_key`) do not count: a save writes beside them. Zarr data is a
    dead save's leftovers only under that save's claim, which every save writing in place puts down before its
    first key and removes after its last (local saves write only in their staging directories); otherwise it
    is another tool's, and the save is refused.
    """
    zarr = sorted(k for k in keys if is_zarr_key(k))
    others = len(keys) - len(zarr)
    if not zarr:
        return Found(ABSENT, others=others)
    if CLAIM in zarr and all(is_own_key(k) for k in zarr):
        return Found(INCOMPLETE, f"{len(zarr)} file(s) of a save that did not finish", others=others)
    nodes = [k for k in zarr if k.removesuffix(LOCK_SUFFIX).rsplit("/", 1)[-1] == ROOT]
    return Found(FOREIGN, f"Zarr data tsckpt did not write ({len(zarr)} file(s), e.g. {(nodes or zarr)[0]!r}, "
                          f"and no root {ROOT} with tsckpt metadata nor a save's claim)")


class Survey:
    """A location's root document and key listing (and, for a save, its claim), requested at once: over an
    object store each is a round trip, and asked together they cost one. ``listing`` False lists only when
    :meth:`keys` is first asked."""

    def __init__(self, kv: ts.KvStore, url: str, *, claim: bool = False, listing: bool = True):
        self.kv, self.url = kv, url
        self._claim = kv.read(CLAIM) if claim else None
        self._root = kv.read(ROOT)
        self._keys = kv.list() if listing else None

    def claim(self) -> ts.KvStore.ReadResult:
        assert self._claim is not None, "surveyed without the claim"
        return _result(self._claim, f"{self.url}: cannot read {CLAIM!r}")

    def root(self) -> tuple[Any, bytes]:
        """The root document's bytes (None when absent) and its storage generation."""
        result = _result(self._root, f"{self.url}: cannot read {ROOT!r}")
        return (result.value if result.state == "value" else None), result.stamp.generation

    def keys(self) -> list[str]:
        if self._keys is None:
            self._keys = self.kv.list()
        return [k.decode("utf-8", "replace") for k in _result(self._keys, f"cannot list {self.url}")]


def _result(future: Any, what: str) -> Any:
    try:
        return future.result()
    except ValueError as e:
        raise storage_error(e, what) from None


def classify(kv: ts.KvStore, url: str, *, inside: bool = False, survey: Survey | None = None) -> Found:
    """What a save into the kvstore at ``url`` finds there, and how many other files it writes beside.

    ``inside``: also list a committed checkpoint's keys, so that one holding Zarr data it does not name counts
    as foreign and its other files are counted (for a save about to replace it). ``survey``: the location's
    reads, already started.
    """
    survey = survey or Survey(kv, url, listing=False)
    raw, _ = survey.root()
    if raw is None:
        return beside_others(survey.keys())
    found = describe_root(raw)
    if not inside or found.state != COMMITTED:
        return found
    own = checkpoint_keys(raw) or is_own_key
    keys = [k for k in survey.keys() if not own(k)]
    zarr = sorted(k for k in keys if is_zarr_key(k))
    if zarr:
        return Found(FOREIGN, f"{found.what}, and inside it Zarr data tsckpt did not write ({len(zarr)} file(s), "
                              f"e.g. {zarr[0]!r})")
    return dataclasses.replace(found, others=len(keys))


def delete_own_keys(kv: ts.KvStore, keys: list[str], url: str, prefix: str = "",
                    own_key: Callable[[str], bool] = is_own_key) -> None:
    """Delete those of ``keys`` that a tsckpt save into ``prefix`` wrote (``own_key``), and nothing else."""
    own = [k for k in keys if k.startswith(prefix) and own_key(k[len(prefix):])]
    try:
        for future in [kv.delete_range(ts.KvStore.KeyRange(k, k + "\0")) for k in own]:
            future.result()
    except ValueError as e:
        raise storage_error(e, f"{url}: cannot delete a save's files") from None


def refuse(found: Found, url: str, *, overwrite: bool, save_id: str, at_commit: bool = False) -> None:
    """Raise unless saving over ``found`` is allowed: a committed checkpoint only with ``overwrite``, Zarr data
    tsckpt did not write (or a file in the way) never, since the save's documents would mix with it."""
    if found.state == FILE:
        raise FileInTheWayError(f"{url} is a file, not a checkpoint directory; refusing to save there "
                                f"(tsckpt never replaces what it did not write): choose another location")
    if found.state == FOREIGN:
        raise ForeignContentError(
            f"{url} holds {found.what}; refusing to save there, with or without overwrite (tsckpt writes "
            f"beside other files, but never over or among Zarr data it did not write): save into a new or "
            f"empty location, such as a subdirectory")
    if overwrite:
        return
    if found.state == COMMITTED:
        if at_commit:
            raise CheckpointExistsError(
                f"Checkpoint already exists at {url}: save {found.save_id} committed there while save "
                f"{save_id} was running; save {save_id} was not published (pass overwrite=True to replace)")
        raise CheckpointExistsError(
            f"Checkpoint already exists at {url}: {found.what}; pass overwrite=True to replace it")


