"""Edit or delete one key of a committed checkpoint, in either layout, as damage on disk would.

Plain: the key is a file below the checkpoint. Packed: a chunk or blob value
is a range of a rank's data file, edited in place (a value of another size is
appended to the file and the index pointed at it); a node document lives in
the index, which is rewritten with the key changed (and the root document's
record of the index with it), so readers meet new bytes under the same key,
which is what a damaged file looks like to them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import numpy as np

from tsckpt.commit.protocol import CHECKSUM_ATTRIBUTE, document_checksum
from tsckpt.format import chunk_table, ocdbt, ocdbt_tree, writers
from tsckpt.format.data_files import Span
from tsckpt.storage import packed


def layout_of(path: str | os.PathLike) -> str:
    with open(os.path.join(path, "zarr.json")) as f:
        return json.load(f)["attributes"]["tsckpt"].get("layout", "plain")


def _root(path: str | os.PathLike) -> dict:
    with open(os.path.join(path, "zarr.json")) as f:
        return json.load(f)


def _index(path: str | os.PathLike) -> tuple[dict, dict[str, bytes | ocdbt.Ref]]:
    """The root document and every key of the packed index with its value, each node read and checked."""
    root = _root(path)
    md = root["attributes"]["tsckpt"]
    return root, packed_values(path, md)


def packed_values(path: str | os.PathLike, md: dict) -> dict[str, bytes | ocdbt.Ref]:
    file, offset, length = md["data_files"]["index"]
    with open(os.path.join(path, file), "rb") as f:
        data = np.frombuffer(f.read(), dtype=np.uint8)
    files = [f[0] for r in md["data_files"]["ranks"] for f in r["files"]] + [file]
    tree = packed.BTreeIndex(Span(file, offset, length), lambda spans: [data[o:o + n] for _, o, n in spans],
                             files, file)
    return tree.everything()


def _rewrite(path: str | os.PathLike, values: dict[str, bytes | ocdbt.Ref]) -> None:
    """Write a new index holding ``values`` and point the root document at it (checksum updated); where a
    chunk or blob moved or went, its writer's chunk table says so too (tsckpt's readers look there)."""
    _, old = _index(path)
    for key in sorted(set(old) | set(values)):
        if old.get(key) != values.get(key) and isinstance(old.get(key, values.get(key)), ocdbt.Ref):
            new = values.get(key)
            _edit_table(path, key, new if isinstance(new, ocdbt.Ref) else None)
    root = _root(path)
    md = root["attributes"]["tsckpt"]
    keys = sorted(values)
    entries = ocdbt.Entries.of([k.encode() for k in keys], [values[k] for k in keys])
    tree = ocdbt_tree.build_tree(entries, path=md["data_files"]["index"][0], max_node_bytes=packed.NODE_BYTES)
    with open(os.path.join(path, md["data_files"]["index"][0]), "wb") as f:
        f.write(tree.nodes)
    manifest = ocdbt.Manifest(ocdbt.new_uuid(), tree.root, tree.height, tree.stats, 0)
    with open(os.path.join(path, "manifest.ocdbt"), "wb") as f:
        f.write(manifest.encode())
    md["data_files"]["index"] = [md["data_files"]["index"][0], tree.root.offset, tree.root.length]
    root["attributes"][CHECKSUM_ATTRIBUTE] = document_checksum(md)
    with open(os.path.join(path, "zarr.json"), "w") as f:
        json.dump(root, f)


def delete_prefix(path: str | os.PathLike, rel: str) -> None:
    """Delete every key below ``rel`` (an array's whole directory)."""
    rel = rel.strip("/") + "/"
    if layout_of(path) == "plain":
        for top, _, files in os.walk(os.path.join(path, rel)):
            for name in files:
                os.remove(os.path.join(top, name))
        return
    _, index = _index(path)
    _rewrite(path, {k: v for k, v in index.items() if not k.startswith(rel)})


def read_key(path: str | os.PathLike, key: str) -> bytes:
    if layout_of(path) == "plain":
        with open(os.path.join(path, key), "rb") as f:
            return f.read()
    _, index = _index(path)
    value = index.get(key)
    assert value is not None, f"{key} is not in {path}"
    if not isinstance(value, ocdbt.Ref):
        return value
    with open(os.path.join(path, value.path), "rb") as f:
        f.seek(value.offset)
        return f.read(value.length)


def write_key(path: str | os.PathLike, key: str, value: bytes | None) -> None:
    """Replace ``key`` with ``value``, or delete it (None)."""
    if layout_of(path) == "plain":
        if value is None:
            os.remove(os.path.join(path, key))
        else:
            with open(os.path.join(path, key), "wb") as f:
                f.write(value)
        return
    _, index = _index(path)
    values = dict(index)
    old = values.get(key)
    if value is None:
        values.pop(key, None)
    elif isinstance(old, ocdbt.Ref) and len(value) == old.length:  # damage in place, as on disk
        with open(os.path.join(path, old.path), "r+b") as f:
            f.seek(old.offset)
            f.write(value)
        return
    elif isinstance(old, ocdbt.Ref):  # another size: appended, and the index points there
        full = os.path.join(path, old.path)
        at = os.path.getsize(full)
        with open(full, "ab") as f:
            f.write(value)
        values[key] = ocdbt.Ref(old.path, at, len(value))
        _grow(path, old.path, at + len(value))
    else:
        values[key] = value
    _rewrite(path, values)


def _edit_table(path: str | os.PathLike, key: str, ref: ocdbt.Ref | None) -> None:
    """Point the row of ``key`` in its writer's chunk table at ``ref``, or drop it (None): the table is written
    anew at the end of its file, and the root document pointed there."""
    root = _root(path)
    md = root["attributes"]["tsckpt"]
    array, _, name = key.rpartition("/")
    tensor = next((t for t in md["tensors"].values() if t["path"] == array), None)
    if tensor is None:
        flat = 0
        rank = next(o["writer"] for o in md["objects"].values() if o.get("path") == array)
    else:
        grid = [-(-n // c) for n, c in zip(tensor["shape"], tensor["chunk_shape"])]
        index = [int(i) for i in name[2:].split(".")] if name != "c" else []
        flat = int(np.ravel_multi_index(index, grid)) if grid else 0
        ranks = writers.decode(tensor["writers"], int(np.prod(grid)) if grid else 1, md["world_size"], array)
        rank = int(ranks[flat])
    record = md["data_files"]["ranks"][rank]
    file, offset, length = record["table"]
    with open(os.path.join(path, file), "rb") as f:
        data = np.frombuffer(f.read(), dtype=np.uint8)[offset:offset + length]
    reader = chunk_table.TableReader(length, file, whole_up_to=length)
    chunk_table.look_up({reader: ()}, lambda spans: [data[o:o + n] for _, o, n in spans])
    table = chunk_table.look_up({reader: reader.every_key()}, lambda spans: [data[o:o + n] for _, o, n in spans])[reader]
    records, files = table.records.copy(), list(table.files)
    at = np.flatnonzero((records["array"] == chunk_table.array_key(array)) & (records["chunk"] == flat))
    if ref is None:
        records = np.delete(records, at)
    else:
        if ref.path not in files:
            files.append(ref.path)
        records["file"][at], records["offset"][at], records["length"][at] = files.index(ref.path), ref.offset, ref.length
    encoded = chunk_table.ChunkTable(tuple(files), table.hashed, records).encode()
    full = os.path.join(path, file)
    end = os.path.getsize(full)
    with open(full, "ab") as f:
        f.write(encoded)
    record["table"] = [file, end, len(encoded)]
    with open(os.path.join(path, "zarr.json"), "w") as f:
        json.dump(root, f)
    _grow(path, file, end + len(encoded))


def _grow(path: str | os.PathLike, file: str, size: int) -> None:
    """Record a data file's new size in the root document, as a writer of that damage would."""
    root = _root(path)
    md = root["attributes"]["tsckpt"]
    for rank in md["data_files"]["ranks"]:
        for f in rank["files"]:
            if f[0] == file:
                f[1] = size
    root["attributes"][CHECKSUM_ATTRIBUTE] = document_checksum(md)
    with open(os.path.join(path, "zarr.json"), "w") as f:
        json.dump(root, f)


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
    """Replace a value blob with a well-formed one (valid crc32c, its zarr.json declaring its size) holding ``payload``."""
    import crc32c

    doc = json.loads(read_key(path, f"{rel}/zarr.json"))
    doc["shape"] = [len(payload)]
    doc["chunk_grid"]["configuration"]["chunk_shape"] = [max(len(payload), 1)]
    write_key(path, f"{rel}/zarr.json", json.dumps(doc).encode())
    write_key(path, f"{rel}/c.0", payload + crc32c.crc32c(payload).to_bytes(4, "little"))
