"""Non-tensor values as DCP passes them (``BYTE_IO`` items, ``io.BytesIO``) between a rank's planner and its
storage layer, in both directions.

* :class:`EncodedValue`: a value tsckpt's save planner serialized, tagged with
  the encoding the writer records (DCP's default planner passes a plain
  ``io.BytesIO`` of ``torch.save`` bytes instead, which :func:`encode_bytes`
  decodes safely so that plain data is stored as JSON all the same);
* :class:`DecodedValue`: a value the reader already restored safely, so the
  load planner does not unpickle it again.
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

    A tagged :class:`EncodedValue` is taken as it is. DCP's default planner
    sends the ``torch.save`` bytes of every value; they are loaded with
    ``weights_only=True`` (which runs no code from them), and values that are
    plain data are stored as JSON, as tsckpt's planner would have. Anything
    else keeps its original bytes.
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
