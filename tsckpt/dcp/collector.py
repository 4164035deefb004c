"""Python's cycle collector held off while a rank moves a checkpoint's pieces.

Reading or writing a checkpoint allocates a few objects per piece (a planned
read, its bytes' slot, a transfer), thousands per rank, and no cycles that
outlive the call. Each few hundred allocations start a collection, and every
tenth of those a full one, which walks every object in the process: a
training process's whole heap. On the S3 benchmark's small state a replicated
load ran one or two full collections a rank, 0.05-0.2 s of a 1.05 s load.
PyTorch's ``get_state_dict``/``set_state_dict`` hold the collector off for
the same reason. Reference counting still frees everything else at once; any
cycles wait for the next collection after the call.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_held = 0
_was_enabled = False


@contextlib.contextmanager
def held_off() -> Iterator[None]:
    """No automatic cycle collection inside (on any thread of the process); as it was once every caller is out."""
    global _held, _was_enabled
    with _lock:
        if not _held:
            _was_enabled = gc.isenabled()
            gc.disable()
        _held += 1
    try:
        yield
    finally:
        with _lock:
            _held -= 1
            if not _held and _was_enabled:
                gc.enable()
