"""Edit or delete one key of a committed checkpoint, in either layout, as damage on disk would.

Plain: the key is a file below the checkpoint. Packed: the key lives in the
joined OCDBT database; writing it there gives readers new bytes under the same
key, which is what a damaged data file looks like to them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import numpy as np
import tensorstore as ts

from tsckpt.format import zarr_json
from tsckpt.storage.packed import PackedLayout


def layout_of(path: str | os.PathLike) -> str:
    with open(os.path.join(path, "zarr.json")) as f:
        return json.load(f)["attributes"]["tsckpt"].get("layout", "plain")


def kvstore_spec(path: str | os.PathLike, rel: str = "") -> dict:
    """A writable kvstore spec of the directory ``rel`` (an array's path) of the checkpoint at ``path``."""
    base = {"driver": "file", "path": os.path.abspath(path) + "/"}
    prefix = rel.strip("/") + "/" if rel.strip("/") else ""
    if layout_of(path) == "plain":
        return {**base, "path": base["path"] + prefix}
    return {**PackedLayout().root_database(base, writable=True), "path": prefix}


def _database(path: str | os.PathLike) -> ts.KvStore:
    return ts.KvStore.open(kvstore_spec(path)).result()


def delete_prefix(path: str | os.PathLike, rel: str) -> None:
    """Delete every key below ``rel`` (an array's whole directory)."""
    rel = rel.strip("/") + "/"
    ts.KvStore.open(kvstore_spec(path)).result().delete_range(
        ts.KvStore.KeyRange(rel, rel[:-1] + chr(ord("/") + 1))).result()


def read_key(path: str | os.PathLike, key: str) -> bytes:
    if layout_of(path) == "plain":
        with open(os.path.join(path, key), "rb") as f:
            return f.read()
    got = _database(path).read(key).result()
    assert got.state == "value", f"{key} is not in {path}"
    return bytes(got.value)


def write_key(path: str | os.PathLike, key: str, value: bytes | None) -> None:
    """Replace ``key`` with ``value``, or delete it (None)."""
    if layout_of(path) == "plain":
        if value is None:
            os.remove(os.path.join(path, key))
        else:
            with open(os.path.join(path, key), "wb") as f:
                f.write(value)
        return
    db = _database(path)
    if value is None:
        db.delete_range(ts.KvStore.KeyRange(key, key + "\0")).result()
    else:
        db.write(key, value).result()


def edit_key(path: str | os.PathLike, key: str, change: Callable[[bytes], bytes]) -> None:
    write_key(path, key, change(read_key(path, key)))


def flip_byte(data: bytes, at: int = 0, mask: int = 0xFF) -> bytes:
    b = bytearray(data)
    b[at] ^= mask
    return bytes(b)


def edit_array(path: str | os.PathLike, rel: str, **changes) -> None:
    """Change members of the ``zarr.json`` of the array at ``rel``."""
    doc = json.loads(read_key(path, f"{rel}/zarr.json"))
    doc.update(changes)
    write_key(path, f"{rel}/zarr.json", json.dumps(doc).encode())


def rewrite_blob(path: str | os.PathLike, rel: str, payload: bytes) -> None:
    """Replace a value blob's array with a well-formed one (valid crc32c) holding ``payload``."""
    blob = np.frombuffer(payload, dtype=np.uint8)
    arr = ts.open({"driver": "zarr3", "kvstore": kvstore_spec(path, rel), "metadata": zarr_json.blob_metadata(blob.size),
                   "create": True, "delete_existing": True}).result()
    arr.write(blob).result()
