"""What a rank's I/O runs with: the TensorStore context every kvstore and array is opened with (I/O pools,
credentials, retries), and the thread pools of tsckpt's own writers and fetchers.

One context per rank (:func:`make_context`), a child of one process-wide context; a location opened with it is
an :class:`OpenedLocation`. Which credentials an ``s3://`` location takes is :mod:`tsckpt.storage.credentials`.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import tensorstore as ts

from ..errors import NotACheckpointError, OptionError
from . import credentials
from .kvio import S3_RETRIES_ENV, one_line, storage_error
from .location import Location, scheme_for_driver

DEFAULT_IO_CONCURRENCY = 64
#: How often a failed S3 request is retried: TensorStore's own default (32, with delays up to 32 s) keeps an
#: unreachable endpoint hanging for about 15 minutes; 6, with delays of 1 to 16 s, give up after about a minute
#: while still riding out throttling. ``TSCKPT_S3_RETRIES`` or a location's ``context`` member changes it.
DEFAULT_S3_RETRIES = 6

_root_lock = threading.Lock()
_root_context: ts.Context | None = None


def process_context() -> ts.Context:
    """The parent of every context tsckpt makes in this process: TensorStore's memory kvstore lives in a context
    resource, so a ``memory://`` checkpoint written by one writer is read by a later reader."""
    global _root_context
    with _root_lock:
        if _root_context is None:
            _root_context = ts.Context()
            atexit.register(_release_before_shutdown)
        return _root_context


def _release_before_shutdown() -> None:
    """Drop the process context while the interpreter is still whole, not during its finalization.

    Spawned ranks on Python 3.13 aborted now and then during finalization ("terminate called without an active
    exception"): TensorStore objects freed then release Python objects from threads that may no longer take the
    GIL. Those a load holds are freed with it, by reference counting (``tests/test_collector.py``).
    """
    global _root_context
    with _root_lock:
        _root_context = None


def context_spec(io_concurrency: int = DEFAULT_IO_CONCURRENCY, location: Location | None = None, *,
                 sync: bool = True) -> dict[str, Any]:
    """The context resources for ``location``: tsckpt's defaults, then the location's own. ``sync``: whether
    TensorStore fsyncs each file it writes (the commit promises durable data, unless the save asked not to)."""
    spec: dict[str, Any] = {"file_io_concurrency": {"limit": io_concurrency}, "file_io_sync": sync,
                            "data_copy_concurrency": {"limit": max(os.cpu_count() or 1, 1)}}
    if location is None or location.driver == "s3":
        # One source, the one that applies here: the SDK's default chain would log every source it finds empty.
        spec["aws_credentials"] = credentials.resolve().spec
        spec["s3_request_retries"] = s3_retries()
    if location is None:
        return spec
    scheme = scheme_for_driver(location.driver)
    if scheme is not None and scheme.concurrency_resource:
        spec[scheme.concurrency_resource] = {"limit": io_concurrency}
    return spec | dict(location.context)


def s3_retries() -> dict[str, Any]:
    """The ``s3_request_retries`` resource: :data:`DEFAULT_S3_RETRIES`, or ``$TSCKPT_S3_RETRIES``."""
    text = os.environ.get(S3_RETRIES_ENV, "").strip()
    if text and (not text.isdigit() or int(text) < 1):
        raise OptionError(f"{S3_RETRIES_ENV}={text!r}: expected a whole number of retries >= 1")
    return {"max_retries": int(text) if text else DEFAULT_S3_RETRIES, "initial_delay": "1s", "max_delay": "16s"}


def make_context(io_concurrency: int = DEFAULT_IO_CONCURRENCY, location: Location | None = None, *,
                 sync: bool = True) -> ts.Context:
    """One context per rank: shared I/O pools (and credentials) for every array it touches."""
    try:
        return ts.Context(context_spec(io_concurrency, location, sync=sync), parent=process_context())
    except ValueError as e:
        where = f" for {location.url}" if location is not None else ""
        raise OptionError(f"invalid TensorStore context resources{where}: {one_line(e)}") from None


def open_kvstore(location: Location, context: ts.Context) -> ts.KvStore:
    if location.driver == "file":
        path = str(location.spec.get("path", "")).rstrip("/")
        if os.path.isfile(path):
            raise NotACheckpointError(f"{path} is a file, not a checkpoint directory")
    try:
        return ts.KvStore.open(dict(location.spec), context=context).result()
    except ValueError as e:
        raise storage_error(e, f"cannot open checkpoint location {location.url}") from None


@dataclasses.dataclass(frozen=True)
class OpenedLocation:
    """A checkpoint location opened in this process: its context and root kvstore, and how this rank uses them."""

    location: Location
    context: ts.Context
    kvstore: ts.KvStore
    #: Whether what is written here is made durable before the commit (False: ``sync_files=False``).
    sync: bool = dataclasses.field(default=True, kw_only=True)
    #: Concurrent file operations of this rank (``io_concurrency``, DCP's ``thread_count``): TensorStore's,
    #: and the threads of the writers and readers of its local files.
    io_concurrency: int = dataclasses.field(default=DEFAULT_IO_CONCURRENCY, kw_only=True)

    @property
    def url(self) -> str:
        return self.location.url


class ThreadPool:
    """A ``ThreadPoolExecutor`` of at most ``max_workers`` threads, made by the first :meth:`submit`, owned by the one
    writer or fetcher that uses it and ended by :meth:`shutdown` or, at the latest, when its owner is freed.

    A pool used before a fork is not its forked child's: the child's copy counts idle threads that do not exist
    there, and its first task would wait forever; so a pool notices it is in another process and starts anew.
    """

    def __init__(self, max_workers: int, thread_name_prefix: str):
        if max_workers < 1:
            raise ValueError(f"a thread pool needs at least 1 thread, not {max_workers}")
        self.max_workers, self.thread_name_prefix = max_workers, thread_name_prefix
        self._executor: ThreadPoolExecutor | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        if self._pid != os.getpid():
            # A forked child: the parent's threads are not here, and its lock may have been held at the fork.
            self._executor, self._lock, self._pid = None, threading.Lock(), os.getpid()
        executor = self._executor
        if executor is None:
            with self._lock:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(self.max_workers, self.thread_name_prefix)
                executor = self._executor
        return executor.submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True) -> None:
        """End the threads once the work submitted is done (waiting for it with ``wait``); a later
        :meth:`submit` makes new ones."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None and self._pid == os.getpid():
            executor.shutdown(wait=wait)
