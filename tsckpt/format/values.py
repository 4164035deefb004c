"""How non-tensor state-dict values (ints, lists, param_groups...) are stored.

Two encodings, chosen per value:

``json``
    The value is plain data: None, bool, int, float, str, and lists, tuples and
    dicts of those. It is stored inline in the metadata document, readable by
    anyone. JSON has no tuples, non-string keys or NaN, so three tagged forms
    keep the round trip exact: ``{"$tuple": [...]}``, ``{"$dict": [[k, v], ...]}``
    (also used when a string key starts with ``$``) and ``{"$float": "nan"}``.
``torch``
    Anything else is serialized with ``torch.save`` into a ``uint8`` array and
    loaded back with ``torch.load(weights_only=True)``, which cannot run code
    from the file; arbitrary pickled objects need an explicit opt-in.
"""

from __future__ import annotations

import io
import math
import re
from typing import Any

from ..errors import UnsafeObjectError

JSON = "json"
TORCH = "torch"
ENCODINGS = (JSON, TORCH)


class NotJsonable(TypeError):
    pass


def to_json(value: Any) -> Any:
    """Encode ``value`` as tagged JSON, or raise ``NotJsonable``."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {"$float": repr(value)}
    if type(value) is list:
        return [to_json(v) for v in value]
    if type(value) is tuple:
        return {"$tuple": [to_json(v) for v in value]}
    if type(value) is dict:
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: to_json(v) for k, v in value.items()}
        return {"$dict": [[to_json(k), to_json(v)] for k, v in value.items()]}
    raise NotJsonable(type(value).__name__)


def from_json(data: Any) -> Any:
    """Inverse of :func:`to_json`."""
    if isinstance(data, list):
        return [from_json(v) for v in data]
    if isinstance(data, dict):
        if set(data) == {"$tuple"}:
            return tuple(from_json(v) for v in data["$tuple"])
        if set(data) == {"$dict"}:
            return {_hashable(from_json(k)): from_json(v) for k, v in data["$dict"]}
        if set(data) == {"$float"}:
            return float(data["$float"])
        return {k: from_json(v) for k, v in data.items()}
    return data


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


def encode(value: Any) -> tuple[str, Any]:
    """``(JSON, tagged value)`` for plain data, else ``(TORCH, torch.save bytes)``."""
    try:
        return JSON, to_json(value)
    except NotJsonable:
        import torch

        buf = io.BytesIO()
        torch.save(value, buf)
        return TORCH, buf.getvalue()


def load_torch_value(blob: bytes, *, key: str, where: str, allow_pickle: bool,
                     opt_in: str = "allow_pickle=True") -> Any:
    """Restore a ``torch`` encoded value; without ``allow_pickle`` no code from the blob can run.

    ``opt_in`` is how the caller's user allows unpickling, for the error message.
    """
    import torch

    try:
        return torch.load(io.BytesIO(blob), weights_only=not allow_pickle)
    except Exception as e:
        # torch words this "Unsupported global: GLOBAL x.y" or "unsupported GLOBAL x.y whose module ...".
        found = re.search(r"GLOBAL [\w.]+", str(e))
        raise UnsafeObjectError(
            f"value {key!r} in {where} cannot be restored safely "
            f"({found.group(0) if found else type(e).__name__}); "
            f"pass {opt_in} only if you trust this checkpoint"
        ) from None
