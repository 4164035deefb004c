"""One-call save and load with tsckpt's planners chosen for you."""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from ..errors import IncompleteCheckpointError, NotACheckpointError, TsckptError
from ..steps import run_directory_error
from ..storage.kvio import storage_error
from ..storage.location import LocationLike, parse_location
from . import collector, failure
from .load_planner import LoadPlanner
from .planner import SavePlanner
from .reader import TensorStoreReader
from .staging import Stager
from .storage import TensorStoreWriter


def save(state_dict: dict[str, Any], path: LocationLike, *, process_group: dist.ProcessGroup | None = None,
         overwrite: bool = False, **writer_options: Any) -> Metadata:
    """Save ``state_dict`` (DTensors, ShardedTensors, tensors, plain values) to ``path``.

    Collective when a process group is initialized: every rank calls it.
    ``writer_options`` go to :class:`TensorStoreWriter`, e.g. ``base=`` or
    ``incremental=True`` (the previous save beside ``path`` as base)::

        tsckpt.save(state, f"ckpt/step_{step}", incremental=True)

    Unlike ``TensorStoreWriter`` (whose default follows DCP's ``FileSystemWriter``),
    this refuses to replace a complete checkpoint unless ``overwrite=True``.
    """
    writer = TensorStoreWriter(path, overwrite=overwrite, **writer_options)
    try:
        with collector.held_off(), _single_process_quiet():
            planner = SavePlanner(values_group=process_group or (dist.group.WORLD if dist.is_initialized() else None))
            return dcp.save(state_dict, storage_writer=writer, planner=planner, process_group=process_group)
    except (CheckpointException, KeyboardInterrupt) as e:
        raise _plain(e, f"save to {_shown(path)}", _SaveInterrupts(writer, path, process_group)) from None


def async_save(state_dict: dict[str, Any], path: LocationLike, *, process_group: dist.ProcessGroup | None = None,
               overwrite: bool = False, async_checkpointer_type: AsyncCheckpointerType = AsyncCheckpointerType.THREAD,
               **writer_options: Any) -> Any:
    """Like :func:`save` but returns once the state dict is staged in CPU memory (:class:`Stager`).

    ``async_checkpointer_type`` (thread or process) goes to ``dcp.async_save``,
    ``writer_options`` to :class:`TensorStoreWriter`.
    """
    writer = TensorStoreWriter(path, overwrite=overwrite, **writer_options)
    with collector.held_off():
        return dcp.async_save(state_dict, storage_writer=writer, planner=SavePlanner(), process_group=process_group,
                              async_checkpointer_type=async_checkpointer_type, async_stager=Stager())


def load(state_dict: dict[str, Any], path: LocationLike, *, process_group: dist.ProcessGroup | None = None,
         allow_partial_load: bool = False, allow_dtype_cast: bool = False, allow_pickle: bool = False,
         **reader_options: Any) -> None:
    """Load ``path`` into ``state_dict`` in place, resharding to its current placements.

    Raises :class:`~tsckpt.errors.IncompleteCheckpointError` before any
    collective if the checkpoint was never committed. ``reader_options``
    (``io_concurrency``, ``per_thread_copy_ahead``, ``replica_reads``) go to :class:`TensorStoreReader`.
    """
    reader = TensorStoreReader(path, allow_pickle=allow_pickle, **reader_options)
    try:
        reader.prefetch_metadata()  # fail fast with tsckpt's own error, not DCP's wrapped one
    except (IncompleteCheckpointError, NotACheckpointError) as e:
        raise run_directory_error(path, e) from None
    planner = LoadPlanner(allow_partial_load=allow_partial_load, allow_dtype_cast=allow_dtype_cast)
    try:
        with collector.held_off(), _single_process_quiet():
            dcp.load(state_dict, storage_reader=reader, planner=planner, process_group=process_group)
    except (CheckpointException, KeyboardInterrupt) as e:
        raise _plain(e, f"load from {_shown(path)}") from None


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Silence DCP's "torch.distributed is disabled ... single process" warning, and only it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized")
        yield


class _SaveInterrupts:
    """What a save does when Ctrl-C stops it on some rank (:func:`tsckpt.dcp.failure.interrupted`)."""

    def __init__(self, writer: TensorStoreWriter, path: LocationLike, process_group: dist.ProcessGroup | None):
        self.writer, self.process_group, self.shown = writer, process_group, _shown(path)

    def rank(self) -> int:
        return dist.get_rank(self.process_group) if dist.is_available() and dist.is_initialized() else 0

    def error(self, stopped: list[int]) -> BaseException:
        # Set on the coordinator once the save has begun; before that nothing was written.
        target = getattr(self.writer, "_target", None) if self.writer.is_coordinator else None
        save_id, location = getattr(self.writer, "_orders_save_id", None), self.writer.location
        committed = None
        if save_id is not None and location is not None:  # the rank had its orders: it can look for the commit
            committed = lambda: failure.committed_at(location, save_id)  # noqa: E731
        return failure.interrupted(self.shown, self.rank(), stopped, target, committed)

    def own(self, error: TsckptError) -> BaseException:
        """``error`` as this rank raises it: a ``KeyboardInterrupt`` where Ctrl-C was pressed."""
        return KeyboardInterrupt(str(error)) if self.rank() in failure.interrupted_ranks(error) else error


def _shown(path: LocationLike) -> str:
    """The location as the user wrote it, so a command in a message can be pasted as it is."""
    if isinstance(path, (str, os.PathLike)):
        return os.fspath(path)
    try:
        return parse_location(path).url
    except TsckptError:
        return repr(path)


#: How TensorStore's errors start: a status code ("PERMISSION_DENIED: ...").
_TENSORSTORE_STATUS = re.compile(r"^[A-Z][A-Z_]+: ")


def _plain(e: BaseException, doing: str, interrupts: _SaveInterrupts | None = None) -> BaseException:
    """What tsckpt's functions raise instead of ``e``, DCP's CheckpointException or a KeyboardInterrupt: the
    first rank's TsckptError as itself, without DCP's wrapping; a TensorStore error as a StorageError naming
    ``doing`` and the rank; Ctrl-C in a save (``interrupts``) as the line that says what the save left.
    Anything else is ``e``, unchanged."""
    if isinstance(e, KeyboardInterrupt):  # outside DCP's wrapping: between its steps
        if interrupts is None or e.args:  # no save, or already the line that says what it left
            return e
        return interrupts.error([interrupts.rank()])
    assert isinstance(e, CheckpointException)
    # Each failure is DCP's (exception, traceback summary) pair.
    failures = {rank: f[0] if isinstance(f, tuple) else f for rank, f in sorted(e.failures.items())}
    stopped = [rank for rank, x in failures.items() if isinstance(x, KeyboardInterrupt)]
    if stopped:
        return interrupts.error(stopped) if interrupts is not None else KeyboardInterrupt()
    # A rank's own error before one relayed from the rank that fetched a region for it (replica reads).
    for exc in sorted((x for x in failures.values() if isinstance(x, TsckptError)),
                      key=lambda x: x.relayed_from is not None):
        return interrupts.own(exc.with_traceback(None)) if interrupts is not None else exc.with_traceback(None)
    for rank, exc in failures.items():
        if isinstance(exc, ValueError) and _TENSORSTORE_STATUS.match(str(exc)):
            return storage_error(exc, f"{doing} failed on rank {rank}")
    return e
