"""A box of a tensor once its reads are planned: one step per stored chunk, each placing its own bytes.

A reader with many boxes in one batch may run every box's steps in the order their bytes arrive
(:func:`by_arrival`): a box's chunks may lie far apart in the files (a column block of a banded save), and run box
by box, one such box holds back every step behind it until the last of its bytes is in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from .byte_reads import Slot


@dataclass(frozen=True)
class ChunkStep:
    """Checks and places one chunk's part of a box from the bytes of ``slots``, then lets them go."""

    slots: tuple[Slot, ...]
    place: Callable[[], object]

    def __call__(self) -> None:
        try:
            self.place()
        finally:
            for slot in self.slots:
                slot.release()

    def turn(self) -> int:
        """When its bytes are in: the turn of the last request it needs in its batch (-1: it needs none)."""
        return max((slot.turn for slot in self.slots), default=-1)


@dataclass(frozen=True)
class PlannedBox:
    """A box's planned reads: ``steps`` fill ``out``. Calling it runs them in order and returns ``out``."""

    out: np.ndarray
    steps: tuple[ChunkStep, ...]

    def __call__(self) -> np.ndarray:
        for step in self.steps:
            step()
        return self.out


@dataclass
class PendingBox:
    """A box read planned on its own: :meth:`result` fetches, checks and returns it."""

    finish: Callable[[], np.ndarray]

    def result(self) -> np.ndarray:
        return self.finish()


def by_arrival(boxes: Sequence[PlannedBox]) -> Iterator[tuple[int, ChunkStep, bool]]:
    """Every step of ``boxes`` (whose batch has run), in the order their bytes arrive: ``(box, step, last)``,
    ``last`` once that box's final step is given. Ties keep the boxes' order."""
    order = sorted((step.turn(), k, j) for k, box in enumerate(boxes) for j, step in enumerate(box.steps))
    left = [len(box.steps) for box in boxes]
    for k, box in enumerate(boxes):
        if not box.steps:
            yield k, ChunkStep((), lambda: None), True
    for _, k, j in order:
        left[k] -= 1
        yield k, boxes[k].steps[j], not left[k]
