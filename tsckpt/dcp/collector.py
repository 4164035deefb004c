"""Python's cycle collector held off while a save or load runs: the one place tsckpt touches ``gc``.

Planning and moving a checkpoint allocate thousands of objects and no lasting cycles, and a full collection
walks a training process's whole heap (0.13-0.31 s over ~310k objects, on the coordinator, where every rank
waits); PyTorch's ``get_state_dict`` holds it off too. ``TSCKPT_HOLD_GC=0`` or :data:`hold` = False leaves it.
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


@contextlib.contextmanager
def held_off() -> Iterator[None]:
    """No automatic cycle collection inside (on any thread) while :data:`hold`; as it was once every caller is out."""
    global _held, _was_enabled
    counted = hold and os.environ.get(HOLD_ENV, "").strip().lower() not in ("0", "false", "no", "off")
    with _lock:
        if counted:
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
