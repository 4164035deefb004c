"""A value whose pickling presses Ctrl-C, so a save can be interrupted at a known point, by a real SIGINT.

Saving a non-tensor value pickles it (``torch.save``) while the rank writes
its items, after the tensors before it in the state dict were handed to the
write threads: a state dict ending with :class:`CtrlC` is interrupted in the
middle of its writes, every time, however fast the disk is. The signal is
armed only in a process whose ``TSCKPT_TEST_CTRL_C`` is ``1``, so the value can
be saved into a source file (for ``tsckpt convert``) without going off.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

ARMED = "TSCKPT_TEST_CTRL_C"


class CtrlC:
    def __reduce__(self) -> tuple[Any, ...]:
        if os.environ.get(ARMED) == "1":
            # To this very thread: os.kill may hand a busy process's signal to another thread, and then a
            # single long sleep here would end, and this raise run, before the handler.
            signal.raise_signal(signal.SIGINT)
            for _ in range(1000):  # short sleeps: the handler runs between them, raising KeyboardInterrupt
                time.sleep(0.01)
            raise AssertionError("SIGINT was sent but no KeyboardInterrupt came")
        return (CtrlC, ())
