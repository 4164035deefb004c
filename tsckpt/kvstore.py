"""Where a checkpoint is stored: locations, TensorStore kvstore specs and contexts.

A location is a plain path, a ``file://`` URL or a full TensorStore kvstore
spec (a dict); it always names a directory-like prefix. Each array's spec is
the root spec with its relative path appended. Torch-free.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import tensorstore as ts

from .errors import TsckptError

DEFAULT_IO_CONCURRENCY = 64


@dataclass(frozen=True)
class Location:
    """The root of a checkpoint as a TensorStore kvstore spec."""

    spec: Mapping[str, Any]

    @property
    def url(self) -> str:
        if self.spec.get("driver") == "file":
            return str(self.spec["path"]).rstrip("/")
        return f"{self.spec.get('driver')}://{self.spec.get('bucket', '')}/{self.spec.get('path', '')}".rstrip("/")

    def child(self, relpath: str) -> dict[str, Any]:
        """The kvstore spec of a sub-directory (an array or group)."""
        return {**self.spec, "path": f"{self.spec.get('path', '')}{relpath.strip('/')}/"}


def parse_location(location: str | os.PathLike[str] | Mapping[str, Any]) -> Location:
    """Turn a path, ``file://`` URL or kvstore spec into a :class:`Location`."""
    if isinstance(location, Mapping):
        spec = dict(location)
        if "driver" not in spec:
            raise TsckptError(f"kvstore spec {spec!r} has no 'driver'")
        spec["path"] = _as_prefix(str(spec.get("path", "")))
        return Location(spec)
    text = os.fspath(location)
    if text.startswith("file://"):
        text = text[len("file://"):]
    elif "://" in text:
        raise TsckptError(f"unsupported checkpoint location {text!r}: expected a local path or file:// URL")
    if not text:
        raise TsckptError("checkpoint location is empty")
    return Location({"driver": "file", "path": _as_prefix(os.path.abspath(text))})


def _as_prefix(path: str) -> str:
    return path if path == "" or path.endswith("/") else path + "/"


def make_context(io_concurrency: int = DEFAULT_IO_CONCURRENCY) -> ts.Context:
    """One context per rank: shared I/O and copy pools for every array it touches."""
    return ts.Context({
        "file_io_concurrency": {"limit": io_concurrency},
        "data_copy_concurrency": {"limit": max(os.cpu_count() or 1, 1)},
    })


def open_kvstore(location: Location, context: ts.Context) -> ts.KvStore:
    return ts.KvStore.open(dict(location.spec), context=context).result()


def read_json(kv: ts.KvStore, key: str) -> Any | None:
    """The parsed JSON at ``key``, or None when the key does not exist."""
    result = kv.read(key).result()
    if result.state != "value":
        return None
    return json.loads(result.value)


def encode_json(doc: Any) -> bytes:
    return json.dumps(doc, indent=1, allow_nan=False).encode("utf-8")
