"""Non-tensor values as DCP passes them (``BYTE_IO`` items, ``io.BytesIO``) between planner and storage layer.

:class:`EncodedValue`: a value tsckpt's save planner serialized, tagged with its
encoding (DCP's default planner passes plain ``torch.save`` bytes, which
:func:`encode_bytes` decodes safely); :class:`DecodedValue`: a value the reader
already restored safely, so the load planner does not unpickle it again.
"""

from __future__ import annotations

import io
import json
from typing import Any

import torch

from ..format import object_values


class EncodedValue(io.BytesIO):
    """Serialized non-tensor value, tagged with the encoding the writer should record."""

    def __init__(self, data: bytes, encoding: str):
        super().__init__(data)
        self.encoding = encoding


def encode_bytes(data: io.BytesIO) -> tuple[str, Any]:
    """How the writer stores a value: ``(JSON, tagged value)`` or ``(TORCH, torch.save bytes)``.

    A tagged :class:`EncodedValue` is taken as it is; ``torch.save`` bytes are
    loaded with ``weights_only=True`` and stored as JSON if plain data, else as they are.
    """
    raw = data.getvalue()
    if isinstance(data, EncodedValue):
        return data.encoding, json.loads(raw) if data.encoding == object_values.JSON else raw
    try:
        value = torch.load(io.BytesIO(raw), weights_only=True)
        return object_values.JSON, object_values.to_json(value)
    except Exception:  # not loadable without unpickling code, or not plain data
        return object_values.TORCH, raw


class DecodedValue(io.BytesIO):
    """A value the reader already restored safely; the bytes are a torch.save of it."""

    def __init__(self, value: Any):
        buf = io.BytesIO()
        torch.save(value, buf)
        super().__init__(buf.getvalue())
        self.value = value
