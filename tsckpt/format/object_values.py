"""How non-tensor state-dict values (ints, lists, param_groups...) are stored (``docs/format.md``, section 7):
plain data as tagged JSON inline in the metadata document, anything else ``torch.save``'d into a ``uint8``
array and restored with ``torch.load(weights_only=True)`` unless unpickling is explicitly allowed."""

from __future__ import annotations

import io
import math
import pickle
import pickletools
import re
import zipfile
from typing import Any

from ..errors import DamagedValueError, MetadataError, UnsafeObjectError

JSON = "json"
TORCH = "torch"
ENCODINGS = (JSON, TORCH)


class NotJsonable(TypeError):
    """A value :func:`to_json` cannot encode."""


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
    """Inverse of :func:`to_json`; a malformed tagged form (a hostile ``{"$dict": 5}``) raises
    :class:`~tsckpt.errors.MetadataError`."""
    if isinstance(data, list):
        return [from_json(v) for v in data]
    if isinstance(data, dict):
        if len(data) == 1:
            tag, inner = next(iter(data.items()))
            if tag in _TAGS:
                return _TAGS[tag](inner)
        return {k: from_json(v) for k, v in data.items()}
    return data


def _tuple(inner: Any) -> tuple[Any, ...]:
    if not isinstance(inner, list):
        raise MetadataError(f"'$tuple' must hold a list, not {_kind(inner)}")
    return tuple(from_json(v) for v in inner)


def _dict(inner: Any) -> dict[Any, Any]:
    if not isinstance(inner, list) or not all(isinstance(p, list) and len(p) == 2 for p in inner):
        raise MetadataError(f"'$dict' must hold a list of [key, value] pairs, not {_kind(inner)}")
    out = {}
    for k, v in inner:
        key = _hashable(from_json(k))
        try:
            hash(key)
        except TypeError:
            raise MetadataError(f"'$dict' key {k!r} cannot be a dict key") from None
        out[key] = from_json(v)
    return out


def _float(inner: Any) -> float:
    if inner not in NON_FINITE:
        raise MetadataError(f"'$float' must be one of {list(NON_FINITE)}, not {_kind(inner)}")
    return float(inner)


def _kind(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"a {type(value).__name__}"


#: The only strings a ``$float`` holds (``repr`` of the non-finite floats).
NON_FINITE = ("nan", "inf", "-inf")
_TAGS: dict[str, Any] = {"$tuple": _tuple, "$dict": _dict, "$float": _float}


def _hashable(key: Any) -> Any:
    # JSON has no tuples: a key that was a tuple arrives as a (possibly nested) list.
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


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
    """Restore a ``torch`` encoded value; without ``allow_pickle`` no code from the blob can run. A damaged blob
    (no readable archive, a member failing its zip CRC, a pickle stream that does not parse) raises
    :class:`~tsckpt.errors.DamagedValueError`; a sound one only ``weights_only=False`` restores raises
    :class:`~tsckpt.errors.UnsafeObjectError`, naming ``opt_in`` (how the caller's user allows unpickling)."""
    import torch

    damage = archive_damage(blob)
    if damage is not None:
        raise DamagedValueError(f"value {key!r} in {where} is damaged: {damage}; "
                                "the checkpoint cannot restore it (restore it from another copy)")
    try:
        # io.BytesIO (a buffer of bytes, e.g. a torch.save'd list of losses) rebuilds without running code.
        with torch.serialization.safe_globals([io.BytesIO]):
            return torch.load(io.BytesIO(blob), weights_only=not allow_pickle)
    except Exception as e:
        damage = _pickle_damage(blob)
        if allow_pickle and damage is None:  # a sound pickle whose classes cannot be rebuilt here
            raise DamagedValueError(f"value {key!r} in {where} cannot be restored: "
                              f"{type(e).__name__}: {_first_line(e)}") from None
        # Only the weights-only unpickler's own refusal means "needs unsafe unpickling";
        # anything else (a missing storage record, a malformed stream) is damage.
        if damage is not None or not isinstance(e, pickle.UnpicklingError):
            raise DamagedValueError(f"value {key!r} in {where} is damaged: "
                                    f"{damage or f'{type(e).__name__}: {_first_line(e)}'}; "
                                    "the checkpoint cannot restore it (restore it from another copy)") from None
        # torch words this "Unsupported global: GLOBAL x.y" or "unsupported GLOBAL x.y whose module ...".
        found = re.search(r"GLOBAL [\w.]+", str(e))
        raise UnsafeObjectError(
            f"value {key!r} in {where} cannot be restored safely "
            f"({found.group(0) if found else type(e).__name__}); "
            f"pass {opt_in} only if you trust this checkpoint"
        ) from None


def archive_damage(blob: bytes) -> str | None:
    """Why ``blob`` is not an intact ``torch.save`` archive, or None (``torch.load`` does not check the zip
    CRCs: a flipped byte inside the pickle could load as another value)."""
    if not blob.startswith(b"PK\x03\x04"):
        return f"not a torch.save archive ({len(blob)} bytes, no zip header)"
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as archive:
            bad = archive.testzip()
            if not any(n.endswith("/data.pkl") for n in archive.namelist()):
                return "the archive has no data.pkl"
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError, NotImplementedError) as e:
        return f"not a readable zip archive ({_first_line(e)})"
    return f"member {bad!r} fails its zip CRC check" if bad is not None else None


def _pickle_damage(blob: bytes) -> str | None:
    """Why the archive's pickle stream does not parse, or None (parsing runs nothing)."""
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as archive:
            name = next(n for n in archive.namelist() if n.endswith("/data.pkl"))
            for _ in pickletools.genops(archive.read(name)):
                pass
    except Exception as e:  # genops raises ValueError and others on malformed streams
        return f"its pickle stream is malformed ({_first_line(e)})"
    return None


def _first_line(e: BaseException) -> str:
    """The first sentence of an error's text (torch appends paragraphs of advice)."""
    lines = str(e).strip().splitlines()
    return lines[0].split(". ")[0][:200] if lines else type(e).__name__
