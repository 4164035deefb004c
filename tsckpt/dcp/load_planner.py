"""DCP load planning: tsckpt's ``LoadPlanner`` refuses, in one error naming every key, what would load wrongly
(a missing key, a tensor where a value was saved or the reverse, another shape, a lossy dtype cast)."""

from __future__ import annotations

import io
import math
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from ..errors import LoadMismatchError
from .torch_private import set_element


def _lossless(saved: torch.dtype, dest: torch.dtype) -> bool:
    """Whether every value of ``saved`` is exactly representable in ``dest`` (``torch.promote_types`` takes
    int64 -> float32 as widening although large integers round)."""
    if torch.promote_types(saved, dest) != dest:
        return False
    if saved.is_floating_point or saved.is_complex or saved == torch.bool:
        return True
    if not (dest.is_floating_point or dest.is_complex):
        return True
    real = dest.to_real() if dest.is_complex else dest
    digits = round(-math.log2(torch.finfo(real).eps)) + 1  # significand bits, implicit one included
    info = torch.iinfo(saved)
    return info.bits - (1 if info.min < 0 else 0) <= digits


#: How many mismatched keys a load's error details; the others are counted.
MISMATCHES_SHOWN = 10

_ALLOWS = {"allow_partial_load": "pass allow_partial_load=True to skip keys the checkpoint does not have",
           "allow_dtype_cast": "pass allow_dtype_cast=True to allow casts that lose precision"}


class Mismatch(NamedTuple):
    """One way a state dict does not match the checkpoint."""

    key: str
    text: str  # naming the key: "tensor 'model.w': checkpoint shape [4, 3] does not match ..."
    allowed_by: str = ""  # the argument of ``tsckpt.load`` that allows it


def mismatch_message(problems: list[Mismatch]) -> str:
    """One line, or a first line naming the keys (the first :data:`MISMATCHES_SHOWN`), then one line each."""
    allows = "; ".join(_ALLOWS[a] for a in dict.fromkeys(p.allowed_by for p in problems) if a)
    if len(problems) == 1:
        return problems[0].text + (f"; {allows}" if allows else "")
    shown, more = problems[:MISMATCHES_SHOWN], len(problems) - MISMATCHES_SHOWN
    first = (f"{len(problems)} keys of the state dict do not match the checkpoint: "
             + ", ".join(repr(p.key) for p in shown) + (f" and {more} more" if more > 0 else "")
             + (f"; {allows}" if allows else ""))
    return "\n".join([first] + [f"  {p.text}" for p in shown] + ([f"  and {more} more"] if more > 0 else []))


class DecodedValue(io.BytesIO):
    """A non-tensor value the reader already restored safely (so it is not unpickled again): a torch.save of it."""

    def __init__(self, value: Any):
        buf = io.BytesIO()
        torch.save(value, buf)
        super().__init__(buf.getvalue())
        self.value = value


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planning (every rank), with safe values and checked shapes and dtypes.

    Args:
        allow_partial_load: keys of ``state_dict`` missing from the checkpoint are skipped.
        allow_dtype_cast: allow loading into a dtype that cannot hold every saved
            value (e.g. float32 -> bfloat16); widening casts are always allowed.
    """

    def __init__(self, *, allow_partial_load: bool = False, allow_dtype_cast: bool = False, **kwargs: Any):
        super().__init__(allow_partial_load=allow_partial_load, **kwargs)
        self.allow_dtype_cast = allow_dtype_cast

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        problems: list[Mismatch] = []
        for fqn, obj in self.state_dict.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if md is None:
                if not self.allow_partial_load:
                    problems.append(Mismatch(fqn, f"key {fqn!r} of the state dict is not in the checkpoint",
                                             "allow_partial_load"))
                continue
            if isinstance(md, TensorStorageMetadata) != isinstance(obj, torch.Tensor):
                # Otherwise DCP would silently replace a tensor by a stored value, or fail obscurely.
                saved, asked = ("a tensor", "a non-tensor value") if isinstance(md, TensorStorageMetadata) \
                    else ("a non-tensor value", "a tensor")
                problems.append(Mismatch(fqn, f"key {fqn!r}: the checkpoint holds {saved} but the state dict has "
                                              f"{asked} ({type(obj).__name__}) there"))
            elif isinstance(md, TensorStorageMetadata):
                problems += self._check_tensor(fqn, md, obj)
        if problems:
            raise LoadMismatchError(mismatch_message(problems))
        return super().create_local_plan()

    def _check_tensor(self, fqn: str, md: TensorStorageMetadata, obj: torch.Tensor) -> list[Mismatch]:
        if tuple(md.size) != tuple(obj.size()):
            return [Mismatch(fqn, f"tensor {fqn!r}: checkpoint shape {list(md.size)} does not match the state "
                                  f"dict's {list(obj.size())}")]
        saved, dest = md.properties.dtype, obj.dtype
        if saved != dest and not _lossless(saved, dest) and not self.allow_dtype_cast:
            return [Mismatch(fqn, f"tensor {fqn!r}: loading {saved} into {dest} would lose precision",
                             "allow_dtype_cast")]
        return []

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        obj = value.value if isinstance(value, DecodedValue) else torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
