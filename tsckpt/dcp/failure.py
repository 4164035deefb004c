"""A save that failed on some rank: what the rank reports, and the one error every rank then raises.

DCP never calls ``finish`` once a rank's ``write_data`` raised, so what the save staged would stay. So a rank
that fails waits for every write it started, then reports the failure as its summary (:func:`failed_summary`);
the coordinator's ``finish`` removes what was staged and raises one
:class:`~tsckpt.errors.SaveFailedError` (:func:`save_failed`) on every rank. Ctrl-C is reported the same way
(:func:`interruption`), and held while a rank starts writes, waits for them or commits (:class:`CtrlC`), so
that no write lands after the clean-up; elsewhere ``tsckpt.save`` calls :func:`interrupted`.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import SaveFailedError, TsckptError
from ..commit.staged import StagedTarget
from ..commit.states import ROOT, describe_root
from ..commit.target import SaveTarget, warn_committed
from ..storage.context import make_context, open_kvstore
from ..storage.kvio import hint, one_line, problem
from ..storage.location import Location
from .contract import RankSummary


@dataclass(frozen=True)
class RankFailure:
    """Why one rank could not write its part of a save."""

    rank: int
    problem: str  # one line, e.g. "no space left on device writing 'model.w'"
    interrupted: bool = False  # by Ctrl-C, rather than an error

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "problem": self.problem, "interrupted": self.interrupted}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> RankFailure:
        return cls(rank=int(doc["rank"]), problem=str(doc["problem"]), interrupted=bool(doc.get("interrupted")))

    @classmethod
    def ctrl_c(cls, rank: int) -> RankFailure:
        return cls(rank, "Ctrl-C", interrupted=True)

    @classmethod
    def of(cls, rank: int, error: BaseException) -> RankFailure:
        """The failure ``error`` describes, with what to check for a refused or unreachable request."""
        if isinstance(error, TsckptError):
            text = one_line(error)
        elif isinstance(error, ValueError):  # how TensorStore reports a failed request
            text = problem(error)
        else:
            text = f"{type(error).__name__}: {one_line(error)}"
        chain: list[BaseException] = []
        at: BaseException | None = error
        while at is not None and at not in chain:  # error and what it was raised from
            chain.append(at)
            at = at.__cause__
        remedy = next((h for e in chain if (h := hint(str(e))) is not None), None)
        return cls(rank, text if remedy is None or remedy in text else f"{text}; {remedy}")


def failed_summary(rank: int, save_id: str, failure: RankFailure) -> RankSummary:
    """What a failing rank returns instead of raising: an empty summary carrying the failure to ``finish``."""
    return RankSummary(rank, save_id, np.zeros(0, np.int32), np.zeros(0, np.int64), None, failure=failure.to_dict())


def commit_or_clean_up(target: SaveTarget, rank: int, summaries: Callable[[], list[RankSummary]],
                       commit: Callable[[list[RankSummary]], None]) -> None:
    """Coordinator (rank ``rank``): ``commit`` the ranks' ``summaries()`` unless a rank failed or was
    interrupted; a failure, an interrupt or a failed commit removes what was staged and raises one line."""
    with CTRL_C.watched():
        try:
            given = summaries()
        except BaseException:
            clean_up(target)
            raise
        failures = sorted((RankFailure.from_dict(s.failure) for s in given if s.failure is not None),
                          key=lambda f: f.rank)
        stopped = [f.rank for f in failures if f.interrupted]
        if stopped:
            raise interruption(target.url, stopped, _outcome(target, settle=False))
        if failures:
            raise save_failed(target.url, failures, clean_up(target))
        try:
            with CTRL_C.step():
                commit(given)
        except KeyboardInterrupt:
            raise interruption(target.url, [rank], _outcome(target, settle=False)) from None
        except Exception as e:
            # Its root document is there: committed, whatever failed after (a request whose answer was lost).
            if committed_at(target.location, target.save_id):
                warn_committed(target.url, target.save_id, [f"{RankFailure.of(rank, e).problem} after its commit"])
                return
            if isinstance(e, TsckptError):
                clean_up(target)
                raise
            reason = f"{RankFailure.of(rank, e).problem} (while committing)"  # e.g. TensorStore's ValueError
            raise save_failed(target.url, [RankFailure(rank, reason)], clean_up(target)) from None
        except BaseException:
            clean_up(target)
            raise


def clean_up(target: SaveTarget) -> str | None:
    """Remove what the save staged; None when done, else what is left and how to remove it."""
    try:
        return target.abort()
    except (OSError, ValueError, TsckptError) as e:
        return f"{problem(e)}; `tsckpt clean {target.url}` removes it"


def save_failed(url: str, failures: list[RankFailure], cleanup: str | None) -> SaveFailedError:
    """The error every rank raises: the first failing rank's problem, the others, then ``cleanup`` (None: removed)."""
    first, others = failures[0], failures[1:]
    lines = [f"save to {url} failed on rank {first.rank}: {first.problem}"
             + (f" (and on {len(others)} other rank{'s' if len(others) > 1 else ''})" if others else "")]
    lines += [f"  rank {f.rank}: {f.problem}" for f in others]
    lines.append("nothing was committed; what the save had written "
                 + ("was removed" if cleanup is None else f"could not be removed: {cleanup}"))
    return SaveFailedError("\n".join(lines))


def interrupted(url: str, rank: int, stopped: list[int], target: SaveTarget | None,
                committed: Callable[[], bool] | None = None) -> BaseException:
    """What rank ``rank`` raises after Ctrl-C stopped the save on the ranks ``stopped`` outside its writers'
    steps (a second Ctrl-C, or one in DCP's collectives). With ``target`` (the coordinator) it removes what was
    staged once the writes still running have landed; other ranks name the command that removes it, or say
    the save is complete if ``committed()``."""
    if target is not None:
        outcome = _outcome(target, settle=True)
    elif committed is not None and committed():
        outcome = f"it had committed: {url} is complete"
    else:
        outcome = f"nothing was committed; `tsckpt clean {url}` removes what it left, if the coordinator did not"
    line = _interrupted_line(url, stopped, outcome)
    return KeyboardInterrupt(line) if rank in stopped else SaveFailedError(line)


def interruption(url: str, stopped: list[int], outcome: str) -> SaveFailedError:
    """The one error of a save that Ctrl-C stopped on the ranks ``stopped``, raised on every rank through DCP
    (``tsckpt.save`` raises its line as a ``KeyboardInterrupt`` on those ranks)."""
    error = SaveFailedError(_interrupted_line(url, stopped, outcome))
    error.interrupted_ranks = list(stopped)  # type: ignore[attr-defined] - kept by pickling, as DCP sends it
    return error


def interrupted_ranks(error: BaseException) -> list[int]:
    return list(getattr(error, "interrupted_ranks", None) or [])


def _interrupted_line(url: str, stopped: list[int], outcome: str) -> str:
    others = len(stopped) - 1
    where = f"Ctrl-C on rank {stopped[0]}" + (f" and {others} other{'s' if others > 1 else ''}" if others else "")
    return f"save to {url} was interrupted ({where}); {outcome}"


def _outcome(target: SaveTarget, *, settle: bool) -> str:
    """What an interrupted save left; ``settle``: wait for writes a rank stopped waiting for to land first."""
    if committed_at(target.location, target.save_id):
        return f"it had committed: {target.url} is complete"
    try:
        if settle and isinstance(target, StagedTarget):  # a staging directory: waits for late writes itself
            cleanup = target.abort_interrupted()
        else:
            if settle:
                _settle_keys(target)
            cleanup = target.abort()
    except (OSError, ValueError, TsckptError) as e:
        cleanup = f"what it had staged could not be removed ({problem(e)}): `tsckpt clean {target.url}` removes it"
    except KeyboardInterrupt:  # Ctrl-C once more: stop waiting, say what is there
        cleanup = f"what it had staged may be left: `tsckpt clean {target.url}` removes it"
    return "nothing was committed; " + ("what it had staged was removed" if cleanup is None else cleanup)


def _settle_keys(target: SaveTarget, *, quiet: float = 0.3, limit: float = 5.0) -> None:
    """Wait until the keys at an in-place target stop changing: writes whose wait was cut short (Ctrl-C
    pressed twice) may still land, and what lands after the clean-up would stay unclaimed."""
    kv = open_kvstore(target.location, make_context(location=target.location))
    deadline = time.monotonic() + limit
    last, calm_since = set(kv.list().result()), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - calm_since < quiet:
        time.sleep(0.05)
        now = set(kv.list().result())
        if now != last:
            last, calm_since = now, time.monotonic()


def committed_at(location: Location, save_id: str) -> bool:
    try:
        kv = open_kvstore(location, make_context(location=location))
        raw = kv.read(ROOT).result()
    except (ValueError, OSError, TsckptError):
        return False
    return raw.state == "value" and describe_root(raw.value).save_id == save_id


class CtrlC:
    """Ctrl-C on a rank's main thread, held while the rank starts writes and raised when that step ends.

    :meth:`watched` puts this object's handler in place of the program's Python handler; Ctrl-C during a
    :meth:`step` is handed to it when the step ends. Outside steps, and for a second Ctrl-C in the same watch,
    the program's handler runs at once.
    """

    def __init__(self) -> None:
        self._previous: Any = None
        self._depth = 0
        self._held: tuple[int, Any] | None = None
        self._pressed = False  # a Ctrl-C came while watched: the next is a second one, never held

    @contextlib.contextmanager
    def watched(self) -> Iterator[None]:
        if self._previous is not None or threading.current_thread() is not threading.main_thread():
            yield  # already watched; or a thread of its own (async_save), which Ctrl-C never interrupts
            return
        previous = signal.getsignal(signal.SIGINT)
        if not callable(previous):  # ignored, the default action (the process ends), or not set from Python
            yield
            return
        self._previous = previous
        signal.signal(signal.SIGINT, self._handle)
        try:
            yield
        finally:
            self._previous, self._held, self._pressed = None, None, False
            signal.signal(signal.SIGINT, previous)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth and self._held is not None:
                held, self._held = self._held, None
                self._previous(*held)

    def _handle(self, signum: int, frame: Any) -> None:
        first, self._pressed = not self._pressed, True
        if self._depth and first:
            self._held = (signum, frame)
            return
        self._held = None
        self._previous(signum, frame)


#: Signals are the process's: one watcher for every writer in it.
CTRL_C = CtrlC()
