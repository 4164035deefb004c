"""Reference files: a packed checkpoint as byte ranges of its data files, for zarr-python without tsckpt.

A kerchunk reference file (version 1), read by fsspec's ``reference://`` filesystem (``docs/reading.md``):
documents inline, chunks as ranges of the data files, named through the template ``u``. Keys are under one
top-level name, as zarr-python 3.1 lists no groups at the root of a reference filesystem."""

from __future__ import annotations

import base64
import json
import os
from typing import Any

from ..commit import protocol as commit
from ..commit.states import ROOT
from ..errors import OptionError, StorageError
from ..storage.kvio import problem
from ..storage.layouts import PACKED
from ..storage.location import LocationLike, parse_location
from ..storage.store import Store

#: The template naming the checkpoint's location in every data file's URL.
TEMPLATE = "u"


def references(location: LocationLike, *, name: str | None = None) -> dict[str, Any]:
    """The reference document (kerchunk format, version 1) of the packed checkpoint at ``location``.

    Args:
        location: the checkpoint, as for :func:`tsckpt.open`.
        name: the top-level name its keys are under (default: the location's last path element).

    Raises:
        OptionError: the checkpoint is in the plain layout, which every Zarr reader opens by path.
    """
    loc = parse_location(location)
    store = Store.open(loc)
    metadata = commit.read_metadata(store.kvstore, loc.url)
    if metadata.layout != PACKED:
        raise OptionError(f"{loc.url} is in the {metadata.layout} layout: zarr-python opens it by path "
                          f"(zarr.open_group({json.dumps(loc.url)}, mode=\"r\")); references are for the packed layout")
    store = store.for_checkpoint(metadata)
    name = name if name is not None else default_name(location)
    try:
        root = store.kvstore.read(ROOT).result()
    except ValueError as e:
        raise StorageError(f"reading {loc.url}/{ROOT} failed: {problem(e)}") from None
    refs: dict[str, Any] = {f"{name}/{ROOT}": _inline(bytes(root.value))}
    for key, where in sorted(store.layout.locator(store, metadata).everything().items()):
        refs[f"{name}/{key}"] = (_inline(where.inline) if where.inline is not None
                                 else [f"{{{{{TEMPLATE}}}}}/{where.file}", where.offset, where.length])
    return {"version": 1, "templates": {TEMPLATE: loc.url}, "refs": refs}


def default_name(location: LocationLike) -> str:
    """The location's last path element (``step_1000``), or ``ckpt`` where it has none."""
    path = str(parse_location(location).spec.get("path", "")).rstrip("/")
    return path.rsplit("/", 1)[-1] or "ckpt"


def write_references(location: LocationLike, out: str | os.PathLike[str], *, name: str | None = None) -> str:
    """Write :func:`references` of ``location`` to the local file ``out``; returns the top-level name."""
    name = name if name is not None else default_name(location)
    text = json.dumps(references(location, name=name), separators=(",", ":"))
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)
    return name


def open_line(out: str | os.PathLike[str], name: str, location: LocationLike) -> str:
    """The zarr-python line that opens the reference file ``out`` (written for ``location``)."""
    options: dict[str, Any] = {"fo": os.path.abspath(out)}
    if parse_location(location).is_object_store:
        options["remote_options"] = {"asynchronous": True}
    return f"g = zarr.open_group({json.dumps(f'reference://{name}')}, storage_options={options!r}, mode=\"r\")"


def _inline(value: bytes) -> str:
    """A value as the reference format stores one: its text, or ``base64:`` and its bytes encoded."""
    try:
        if not value.startswith(b"base64:"):
            return value.decode("utf-8")
    except UnicodeDecodeError:
        pass
    return "base64:" + base64.b64encode(value).decode("ascii")
