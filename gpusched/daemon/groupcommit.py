"""Group commit: the submits that arrive together share one transaction and one fsync.

A durable submit costs one COMMIT with synchronous=FULL, and that fsync, not the daemon's own
work, was what capped submits per second. Here a submit queues its write and waits; the first
write of a batch lets the event loop run a few more turns (the other clients' requests that are
already in the socket buffers get parsed and queued meanwhile), then every queued write is
applied inside one `Store.batch()` and committed at once.

The rules that make it safe:
- nothing is acknowledged before the COMMIT that holds it returned: a write's caller resumes
  only after the batch committed (and learns of a failed COMMIT as an exception);
- one bad write fails alone, not its batch: a batch is first written as one transaction without
  savepoints (the common case, every write succeeds, costs two statements fewer per write); if a
  write raises, that transaction is rolled back and the batch written again with a savepoint per
  write, so writes are re-runnable: `apply` only writes, and its effects in memory wait for
  `committed`;
- what a committed write means in memory (`Write.committed`) runs right after the COMMIT, in the
  same step of the loop (so before any caller resumes), whether or not its caller is still
  waiting: the engine's mirror never misses a stored job.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from gpusched.daemon.store import Store

T = TypeVar("T")
log = logging.getLogger("gpusched.groupcommit")

MAX_BATCH = 1024  # writes per COMMIT: keeps one transaction (and the loop's pause for it) short
MAX_YIELDS = 8  # loop turns a batch waits at most for more writes to join it


@dataclass(eq=False)
class Write(Generic[T]):
    """One write: `apply` runs in the batch's transaction, `committed` once it is durable, and
    `failed` (instead) when it was not written; its caller awaits `future`."""

    apply: Callable[[], T]
    committed: Callable[[T], None]
    failed: Callable[[BaseException], None]
    future: asyncio.Future[T] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


_Done = list[tuple[Write[object], object]]  # writes applied, with what `apply` returned
_Failed = list[tuple[Write[object], BaseException]]  # writes not written, with why


class GroupCommit:
    """Batches writes whose callers must not be answered before they are durable."""

    def __init__(self, store: Store, max_batch: int = MAX_BATCH, max_yields: int = MAX_YIELDS) -> None:
        self.store = store
        self.max_batch = max_batch
        self.max_yields = max_yields
        self._queue: list[Write[object]] = []
        self._flusher: asyncio.Task[None] | None = None
        self.commits = 0  # COMMITs made, and writes in them: their ratio is the mean batch size
        self.writes = 0

    def write(self, work: Write[T]) -> asyncio.Future[T]:
        """Queue `work`; the returned future resolves once its batch is committed (or fails)."""
        self._queue.append(work)  # type: ignore[arg-type]  # the queue holds writes of every result type
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush_soon(), name="gpusched-group-commit")
        return work.future

    async def _flush_soon(self) -> None:
        while self._queue:
            while self.store.batching:  # never inside another batch: its COMMIT would come after our answers
                await asyncio.sleep(0)
            seen = -1
            for _ in range(self.max_yields):  # wait while each loop turn brings more writes
                if len(self._queue) == seen or len(self._queue) >= self.max_batch:
                    break
                seen = len(self._queue)
                await asyncio.sleep(0)
            batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
            self.flush(batch)

    def flush(self, batch: list[Write[object]]) -> None:
        """Apply and commit `batch` now, then settle each write (committed, or failed with its error)."""
        done: _Done = []
        failed: _Failed = []
        try:
            try:
                self._apply_all(batch, done, failed)
            except _WriteFailed:  # rolled back: again, each write in a savepoint, so the bad one fails alone
                done.clear()
                failed.clear()
                self._apply_each(batch, done, failed)
        except Exception as exc:  # BEGIN or COMMIT failed: none of the batch is durable
            log.error("group commit of %d write(s) failed: %s", len(batch), exc)
            settled = {id(work) for work, _ in failed}
            failed += [(work, exc) for work in batch if id(work) not in settled]
            done.clear()
        self.commits += 1
        self.writes += len(done)
        # Answers first, then the mirror: both happen before any caller resumes (this is one
        # synchronous step of the loop), but the callers' wake-ups are queued ahead of what the
        # mirror wakes (the engine's scheduling pass), so an answer never waits for a pass.
        for work, result in done:
            _settle(work.future, None, result)
        for work, result in done:
            try:
                work.committed(result)
            except Exception:  # durable all the same; the engine's next start loads it from the store
                log.exception("applying a committed write failed")
        for work, why in failed:
            work.failed(why)
            _settle(work.future, why)

    def _apply_all(self, batch: list[Write[object]], done: _Done, failed: _Failed) -> None:
        """The common case, every write succeeds: one transaction, no savepoints (store.batch_or_nothing)."""
        with self.store.batch_or_nothing():
            for work in batch:
                if work.future.cancelled():  # its caller gave up before it was written: never write it
                    failed.append((work, asyncio.CancelledError()))
                    continue
                try:
                    done.append((work, work.apply()))
                except Exception as exc:
                    raise _WriteFailed from exc

    def _apply_each(self, batch: list[Write[object]], done: _Done, failed: _Failed) -> None:
        """Each write in its own savepoint: a write that fails is rolled back alone."""
        with self.store.batch():
            for work in batch:
                if work.future.cancelled():
                    failed.append((work, asyncio.CancelledError()))
                    continue
                try:
                    with self.store.savepoint():
                        done.append((work, work.apply()))
                except Exception as exc:  # this write's own savepoint was rolled back
                    failed.append((work, exc))


class _WriteFailed(Exception):
    """A write of an all-or-nothing batch raised: the batch is rolled back and written again write by write."""


def _settle(future: asyncio.Future[T], exc: BaseException | None, result: T | None = None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)  # type: ignore[arg-type]  # result is the T that apply returned
