"""Where each state-dict entry lives inside the checkpoint's Zarr hierarchy: each element of a key path is one
node name, escaped so that no key can climb out of the checkpoint or collide with Zarr's files; the mapping is
injective (``docs/format.md``, section 4)."""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

from ..errors import MetadataError

KeyPath = tuple[str | int, ...]

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_RESERVED = {"zarr.json"}


@functools.lru_cache(maxsize=65536)  # a save names each of thousands of keys several times
def escape_name(name: str) -> str:
    """Encode one path element as a safe Zarr node name."""
    out = _UNSAFE.sub(lambda m: _percent(m.group()), name)
    if out == "":
        return "%"
    if out in _RESERVED or out.startswith(("__", ".")):
        return _percent(out[0]) + out[1:]
    return out


def _percent(ch: str) -> str:
    return "".join(f"%{b:02X}" for b in ch.encode("utf-8"))


def zarr_path(key_path: Sequence[str | int]) -> str:
    """The array or group path, relative to the checkpoint root, for a key path."""
    if not key_path:
        raise MetadataError("a state-dict entry needs a non-empty key path")
    return "/".join(escape_name(str(part)) for part in key_path)


def check_relative_path(path: str, *, what: str) -> str:
    """Reject a stored path that could point outside the checkpoint."""
    parts = path.split("/")
    if (not path or path.startswith("/") or any(ord(ch) < 32 for ch in path)
            or any(p in ("", ".", "..") or "\\" in p or p.startswith("__") for p in parts)):
        raise MetadataError(f"{what}: path {path!r} is not a safe relative path inside the checkpoint")
    return path


def parent_groups(paths: Sequence[str]) -> list[str]:
    """Every intermediate group path above ``paths`` ('' is the root), parents first."""
    groups: set[str] = {""}
    for path in paths:
        parts = path.split("/")
        for i in range(1, len(parts)):
            groups.add("/".join(parts[:i]))
    return sorted(groups, key=lambda p: (p.count("/") if p else -1, p))


def flat_key(key_path: Sequence[str | int]) -> str:
    """DCP's flattened key for a path (elements joined with '.')."""
    return ".".join(str(p) for p in key_path)


def nest(flat: dict[tuple[Any, ...], Any]) -> dict[str, Any]:
    """The nested dict the key paths of ``flat`` describe; integer path elements that number a dict's keys
    0..n-1 make it a list, as DCP's own unflattening does."""
    root: dict[Any, Any] = {}
    for path, value in flat.items():
        node = root
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return _lists(root)


def _lists(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    out = {k: _lists(v) for k, v in node.items()}
    keys = list(out)
    if keys and all(isinstance(k, int) for k in keys) and sorted(keys) == list(range(len(keys))):
        return [out[i] for i in range(len(keys))]
    return out
