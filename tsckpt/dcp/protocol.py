"""What tsckpt's planners and its storage layer hand each other, beyond DCP's own plan items.

Three things travel between :mod:`tsckpt.dcp.planner` and :mod:`tsckpt.dcp.storage`:

* :class:`EncodedValue`: a non-tensor value the save planner serialized, tagged
  with the encoding the writer records (DCP's default planner passes a plain
  ``io.BytesIO`` of ``torch.save`` bytes instead, stored as ``torch``);
* :class:`DecodedValue`: a value the reader already restored safely, so the load
  planner does not unpickle it again;
* :class:`Placements`: the placement record of each tensor of one rank, carried
  in the local plan's ``storage_data`` to the writer's global planning. DCP's
  ``planner_data`` stays DCP's own key-path map, which its global planning
  merges. With DCP's default planner there are no records at all.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.planner import SavePlan

from ..format import values


class EncodedValue(io.BytesIO):
    """Serialized non-tensor value, tagged with the encoding the writer should record."""

    def __init__(self, data: bytes, encoding: str):
        super().__init__(data)
        self.encoding = encoding


def encoding_of(data: io.BytesIO) -> str:
    """How the writer stores a value's bytes: as tagged, or ``torch`` for DCP's plain BytesIO."""
    return data.encoding if isinstance(data, EncodedValue) else values.TORCH


class DecodedValue(io.BytesIO):
    """A value the reader already restored safely; the bytes are a torch.save of it."""

    def __init__(self, value: Any):
        buf = io.BytesIO()
        torch.save(value, buf)
        super().__init__(buf.getvalue())
        self.value = value


@dataclass(frozen=True)
class Placements:
    """One rank's placement records (flat key -> JSON record, mesh inline), from planner to writer."""

    records: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    @staticmethod
    def of(plan: SavePlan) -> Mapping[str, Mapping[str, Any]]:
        """The records a local plan carries; none when another planner made it."""
        data = plan.storage_data
        return data.records if isinstance(data, Placements) else {}
