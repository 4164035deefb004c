"""Python's cycle collector held off while a save or load runs: the one place tsckpt touches ``gc``.

Planning and moving a checkpoint's pieces allocate thousands of objects per
rank and no cycles that outlive the call, and every few hundred allocations
start a collection; a full one walks the whole heap of a training process
(0.13-0.31 s over ~310k objects, on the coordinator, where every rank waits).
PyTorch's ``get_state_dict``/``set_state_dict`` hold the collector off too.

``tsckpt.save``, ``load`` and ``async_save`` hold it off for the whole call,
``TensorStoreReader`` while it plans and reads. ``TSCKPT_HOLD_GC=0`` in the
environment, or :data:`hold` set to False, leaves the collector alone.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator

#: The environment variable that, set to 0, leaves the collector alone.
HOLD_ENV = "TSCKPT_HOLD_GC"
#: Whether saves and loads hold the collector off (and ``$TSCKPT_HOLD_GC`` is not 0).
hold = True

_lock = threading.Lock()
_held = 0
_was_enabled = False


def holding() -> bool:
    """Whether :func:`held_off` holds the collector off now: :data:`hold`, and ``$TSCKPT_HOLD_GC`` is not 0."""
    return hold and os.environ.get(HOLD_ENV, "").strip().lower() not in ("0", "false", "no", "off")


@contextlib.contextmanager
def held_off() -> Iterator[None]:
    """No automatic cycle collection inside (on any thread of the process); as it was once every caller is out.

    Nothing changes where :func:`holding` is false.
    """
    global _held, _was_enabled
    with _lock:
        if not holding():
            counted = False
        else:
            counted = True
            if not _held:
                _was_enabled = gc.isenabled()
                gc.disable()
            _held += 1
    try:
        yield
    finally:
        if counted:
            with _lock:
                _held -= 1
                if not _held and _was_enabled:
                    gc.enable()
