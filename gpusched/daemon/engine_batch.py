"""Many jobs' changes in one COMMIT (cancel, hold, release, suspend, resume of an array), and what
happens to memory when that COMMIT fails: it goes back to what the store still says."""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterator
from contextlib import contextmanager

from gpusched.daemon.engine_core import EngineCore
from gpusched.model import Job, JobState

log = logging.getLogger("gpusched.engine")


class BatchMixin(EngineCore):
    """`batch()`: the store's batch, undone in memory if its COMMIT fails."""

    @contextmanager
    def batch(self) -> Iterator[None]:
        """`store.batch()` for many jobs' changes (cancel, hold, ... of an array), and if its COMMIT
        fails (a full disk), every job changed in it goes back in memory to what the store still
        says: the request is answered with an error, so nothing of it may stay applied."""
        if self.store.batching or self._batch_log is not None:
            yield
            return
        changed: dict[int, tuple[Job, Job]] = {}
        self._batch_log = changed
        failed_inside: BaseException | None = None
        try:
            with self.store.batch():
                try:
                    yield
                except BaseException as exc:  # the changes made before it still commit
                    failed_inside = exc
                    raise
        except BaseException as exc:
            if exc is not failed_inside:  # the COMMIT itself failed: none of the batch is stored
                self._batch_log = None
                self._revert(changed)
            raise
        finally:
            self._batch_log = None

    def _revert(self, changed: dict[int, tuple[Job, Job]]) -> None:
        for before, after in reversed(list(changed.values())):
            try:
                log.warning("job %d: back to %s (its change to %s was not committed)", before.id, before.state,
                            after.state)
                self._follow(after, before)
                if after.state is JobState.SUSPENDED and before.state is JobState.RUNNING and before.pid:
                    self.executor.signal(before.pid, signal.SIGCONT)  # its SIGSTOP stands for nothing now
            except Exception:
                log.exception("job %d: could not go back to its stored state", before.id)
