"""``tsckpt://``: checkpoints by URL for zarr-python, xarray and dask, whatever the layout (``docs/reading.md``).

fsspec finds ``tsckpt`` through this package's ``fsspec.specs`` entry point: ``tsckpt://ckpt/step_1000`` opens
with tsckpt installed, never imported. After ``tsckpt://`` comes a location as :func:`tsckpt.open` takes one,
optionally followed by a group or array inside it; its Zarr keys are read through :func:`tsckpt.zarr_store`.
Loading this module imports tsckpt, which registers its data types with zarr-python."""

from __future__ import annotations

import asyncio
import io
import json
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fsspec.asyn import AsyncFileSystem
from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, SuffixByteRequest
from zarr.core.buffer import default_buffer_prototype

from ..commit.states import ROOT, is_data_file
from ..errors import LocationError, NotACheckpointError
from ..storage.context import DEFAULT_IO_CONCURRENCY, make_context, open_kvstore
from ..storage.kvio import problem
from ..storage.location import LocationLike, parse_location
from .zarr_store import TensorStoreZarrStore, zarr_store

PROTOCOL = "tsckpt"


def url(location: LocationLike) -> str:
    """The ``tsckpt://`` URL of a checkpoint location: ``tsckpt:///abs/path``, ``tsckpt://s3://bucket/prefix``."""
    return f"{PROTOCOL}://{parse_location(location).url}"


def open_line(location: LocationLike) -> str:
    """The line of Python that opens ``location`` with zarr-python by URL, to paste into a notebook. Spec
    members given with the location (an ``endpoint`` in a JSON location) go into ``storage_options``."""
    given: Any = location
    if isinstance(location, str) and location.lstrip().startswith("{"):
        given = json.loads(location)
    members = ({k: v for k, v in given.items() if k not in ("url", "driver", "bucket", "path")}
               if isinstance(given, Mapping) else {})
    options = f", storage_options={{'spec': {members!r}}}" if members else ""
    # JSON's string literal is Python's too, and keeps the double quotes notebooks use.
    return f'g = zarr.open_group({json.dumps(url(location))}, mode="r"{options})  # zarr-python, with tsckpt installed'


@dataclass
class _Open:
    """A checkpoint found under some path: its store, and its root document as it was when opened."""
    store: TensorStoreZarrStore
    root: bytes


class TsckptFileSystem(AsyncFileSystem):
    """A read-only fsspec filesystem whose files are the Zarr keys of the checkpoints it finds.

    A path is a checkpoint location (the nearest at or above it whose root ``zarr.json`` is a tsckpt document)
    followed by a key inside it. Each checkpoint is opened once, and again when its root document changes.

    Args:
        io_concurrency: concurrent requests per checkpoint, as for :func:`tsckpt.zarr_store`.
        spec: kvstore spec members added to every object-store location (``endpoint``, ``aws_region``,
            ``context``...): ``storage_options={"spec": {"endpoint": ...}}`` in zarr-python, xarray or dask.
            Without it the environment applies (``AWS_ENDPOINT_URL``, ``AWS_REGION``, the credentials chain).
    """

    protocol = (PROTOCOL,)
    root_marker = ""

    def __init__(self, *args: Any, io_concurrency: int = DEFAULT_IO_CONCURRENCY,
                 spec: Mapping[str, Any] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.io_concurrency, self.spec = io_concurrency, dict(spec or {})
        self._checkpoints: dict[str, _Open] = {}
        self._lock = threading.Lock()

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        text = str(path).removeprefix(f"{PROTOCOL}://")
        scheme, sep, rest = text.partition("://")
        if sep and scheme != "file":
            return f"{scheme}://{rest.rstrip('/')}"
        local = rest if sep else text
        # Absolute, so that a copy unpickled elsewhere (a dask worker) names the same files.
        return os.path.abspath(os.path.expanduser(local)) if local else ""

    @staticmethod
    def _candidates(path: str) -> list[str]:
        """``path`` and the locations above it, nearest first, down to a bucket (never the filesystem root)."""
        scheme, sep, rest = path.partition("://")
        head, parts = (f"{scheme}://", rest.split("/")) if sep else ("/", path.strip("/").split("/"))
        return [head + "/".join(parts[:n]) for n in range(len(parts), 0, -1) if parts[n - 1]]

    def _location(self, root: str) -> Any:
        return {"url": root, **self.spec} if self.spec and "://" in root else root

    def _root_document(self, candidate: str) -> bytes | None:
        """The ``zarr.json`` right under ``candidate`` if it is a checkpoint's root document, else None (one that
        is not JSON counts: opening it says what is wrong, where skipping it would say "not found")."""
        try:
            loc = parse_location(self._location(candidate))
            result = open_kvstore(loc, make_context(self.io_concurrency, loc)).read(ROOT).result()
        except (NotACheckpointError, LocationError):
            return None  # a file (a key of a plain checkpoint), or no location at all (a bare bucket name)
        except ValueError as e:
            raise OSError(f"reading {candidate}/{ROOT} failed: {problem(e)}") from None
        if result.state != "value":
            return None
        raw = bytes(result.value)
        try:
            doc = json.loads(raw)
        except ValueError:
            return raw
        attrs = doc.get("attributes") if isinstance(doc, dict) else None
        found = isinstance(attrs, dict) and doc.get("node_type") == "group" and "tsckpt" in attrs
        return raw if found else None

    def _checkpoint(self, path: str) -> tuple[str, _Open]:
        """The checkpoint holding ``path``: its location and what was opened there."""
        candidates = self._candidates(path)
        with self._lock:
            for root in candidates:
                if root in self._checkpoints:
                    return root, self._checkpoints[root]
        for root in candidates:
            document = self._root_document(root)
            if document is not None:
                found = _Open(zarr_store(self._location(root), io_concurrency=self.io_concurrency), document)
                with self._lock:
                    return root, self._checkpoints.setdefault(root, found)
        raise FileNotFoundError(f"no tsckpt checkpoint at or above {path}")

    async def _split(self, path: str) -> tuple[str, _Open, str]:
        """(the checkpoint's location, what is open there, the key of ``path`` in it: "" for the root)."""
        path = self._strip_protocol(path)
        root, found = await asyncio.to_thread(self._checkpoint, path)
        return root, found, path[len(root) + 1:]

    async def _root(self, root: str, found: _Open) -> bytes:
        """The root document as stored now; a checkpoint saved over the one opened is opened afresh."""
        value = await found.store.get(ROOT, default_buffer_prototype())
        if value is None:
            raise FileNotFoundError(f"{root}/{ROOT}: the checkpoint is gone")
        current = value.to_bytes()
        if current != found.root:
            store = await asyncio.to_thread(zarr_store, self._location(root), io_concurrency=self.io_concurrency)
            with self._lock:
                self._checkpoints[root] = _Open(store, current)
        return current

    async def _cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        root, found, key = await self._split(path)
        if not key:
            raise IsADirectoryError(path)
        if is_data_file(key):
            raise FileNotFoundError(path)  # a plain checkpoint's digest tables: tsckpt's, not Zarr's
        if key == ROOT:
            return (await self._root(root, found))[start:end]
        if (start is not None and end is not None and start < 0) or (end is not None and end < 0):
            return (await self._value(found.store, path, key, None))[start:end]
        return await self._value(found.store, path, key, _request(start, end))

    @staticmethod
    async def _value(store: TensorStoreZarrStore, path: str, key: str, byte_range: ByteRequest | None) -> bytes:
        value = await store.get(key, default_buffer_prototype(), byte_range)
        if value is None:
            raise FileNotFoundError(path)
        return value.to_bytes()

    async def _exists(self, path: str, **kwargs: Any) -> bool:
        try:
            _, found, key = await self._split(path)
        except FileNotFoundError:
            return False
        return not key or await found.store.exists(key) or bool(await self._below(found, key))

    async def _info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        path = self._strip_protocol(path)
        root, found, key = await self._split(path)
        if not key:
            return _directory(path)
        if await found.store.exists(key):
            # Sizes are not listed anywhere cheaper: the value is read (zarr asks only for getsize()).
            return _file(path, len(await self._cat_file(path)))
        if await self._below(found, key):
            return _directory(path)
        raise FileNotFoundError(path)

    @staticmethod
    async def _below(found: _Open, key: str) -> list[str]:
        """Every Zarr key below ``key`` ("" for the root), relative to it."""
        start = f"{key}/" if key else ""
        return [k[len(start):] async for k in found.store.list_prefix(start) if not is_data_file(k)]

    async def _ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        path = self._strip_protocol(path)
        _, found, key = await self._split(path)
        below = await self._below(found, key)
        if not below and key:
            if not await found.store.exists(key):
                raise FileNotFoundError(path)
            return [_file(path)] if detail else [path]
        children: dict[str, bool] = {}  # name -> is a directory
        for k in below:
            name, slash, _ = k.partition("/")
            children[name] = children.get(name, False) or bool(slash)
        entries = [(_directory if is_dir else _file)(f"{path}/{name}") for name, is_dir in sorted(children.items())]
        return entries if detail else [e["name"] for e in entries]

    async def _find(self, path: str, maxdepth: int | None = None, withdirs: bool = False, **kwargs: Any) -> Any:
        path = self._strip_protocol(path)
        detail = kwargs.pop("detail", False)
        try:
            _, found, key = await self._split(path)
        except FileNotFoundError:
            return {} if detail else []
        out: dict[str, dict[str, Any]] = {}
        for k in await self._below(found, key):
            parts = k.split("/")
            if maxdepth is not None and len(parts) > maxdepth:
                continue
            out[f"{path}/{k}"] = _file(f"{path}/{k}")
            if withdirs:
                for n in range(1, len(parts)):
                    name = f"{path}/{'/'.join(parts[:n])}"
                    out.setdefault(name, _directory(name))
        if not out and key and await found.store.exists(key):
            out[path] = _file(path)
        names = sorted(out)
        return {n: out[n] for n in names} if detail else names

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> io.BytesIO:
        if mode != "rb":
            raise PermissionError(self._read_only(path))
        return io.BytesIO(self.cat_file(path))

    def _read_only(self, path: Any) -> str:
        return f"{PROTOCOL}:// is read-only: cannot change {path}"

    async def _refuse(self, path: Any, *args: Any, **kwargs: Any) -> None:
        raise PermissionError(self._read_only(path))

    _pipe_file = _rm_file = _rm = _mkdir = _makedirs = _refuse

    async def _put_file(self, lpath: str, rpath: str, *args: Any, **kwargs: Any) -> None:
        raise PermissionError(self._read_only(rpath))

    _cp_file = _put_file


def _request(start: int | None, end: int | None) -> ByteRequest | None:
    if start is None or start == 0:
        return None if end is None else RangeByteRequest(0, end)
    if start < 0:
        return SuffixByteRequest(-start)
    return OffsetByteRequest(start) if end is None else RangeByteRequest(start, end)


def _file(name: str, size: int | None = None) -> dict[str, Any]:
    return {"name": name, "type": "file", "size": size}


def _directory(name: str) -> dict[str, Any]:
    return {"name": name, "type": "directory", "size": 0}
