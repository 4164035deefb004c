"""One rank's writes grouped into transactions, for layouts that want them (the packed layout).

Without a transaction every TensorStore flush of an OCDBT database is a commit
of its own: a manifest write and a small data file each time. Writing through
one transaction per batch makes each batch one commit with one data file of about
the layout's ``batch_bytes``. A batch is committed once that many bytes were
written; its commit runs while the rank writes the next batch, and is waited for
before the one after, so what transactions hold in memory (references to the
source arrays, or the host copies of device tensors) stays within two batches.

For the plain layout :meth:`RankBatch.bind` returns arrays unchanged and
commits are no-ops.
"""

from __future__ import annotations

from collections.abc import Callable

import tensorstore as ts

from ..errors import StorageError
from .kvio import problem
from .layouts import KvLayout


class RankBatch:
    """The current transaction of one rank's save; see the module docstring.

    ``drain`` waits for every write issued so far (their futures resolve when
    the write is staged in the transaction); it runs before each commit.
    """

    def __init__(self, layout: KvLayout, drain: Callable[[], None], where: str = ""):
        self.layout = layout
        self.drain = drain
        self.where = where  # named in errors, unless the caller names it itself
        self.txn = layout.rank_transaction()
        self.nbytes = 0
        self.names: list[str] = []  # what the current batch holds, for errors
        self._committing: tuple[ts.Future, list[str]] | None = None

    def bind(self, array: ts.TensorStore | ts.KvStore) -> ts.TensorStore | ts.KvStore:
        """``array`` (or a kvstore) writing through the current transaction (if any)."""
        return array if self.txn is None else array.with_transaction(self.txn)

    def wrote(self, name: str, nbytes: int) -> None:
        """Count ``nbytes`` of ``name`` just written; commit the batch once it holds ``layout.batch_bytes``."""
        if self.txn is None:
            return
        self.nbytes += nbytes
        if not self.names or self.names[-1] != name:
            self.names.append(name)
        if self.nbytes >= self.layout.batch_bytes > 0:
            self._start_commit()
            self.txn, self.nbytes, self.names = self.layout.rank_transaction(), 0, []

    def commit(self) -> None:
        """Wait for the writes issued, then make them durable (call once after the last write)."""
        if self.txn is None:
            return
        self._start_commit()
        self._wait()

    def abandon(self) -> None:
        """After a failure: wait for the batch being committed (whatever its outcome), drop the current one."""
        committing, self._committing = self._committing, None
        if committing is not None:
            try:
                committing[0].result()
            except ValueError:
                pass
        if self.txn is not None:
            self.txn.abort()
            self.txn = None

    def _start_commit(self) -> None:
        assert self.txn is not None
        self.drain()
        self._wait()  # the previous batch: one commit at a time per database
        self._committing = (self.txn.commit_async(), self.names)

    def _wait(self) -> None:
        committing, self._committing = self._committing, None
        if committing is None:
            return
        future, names = committing
        try:
            future.result()
        except ValueError as e:
            # The data reaches storage only here, so this is where a full disk shows.
            what = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise StorageError(f"{problem(e)} writing {what or 'nothing'}"
                                + (f" to {self.where}" if self.where else "")) from None
