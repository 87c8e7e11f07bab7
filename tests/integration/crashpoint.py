"""Run the real gpuschedd, but SIGKILL it at one exact point, as a `kill -9` landing there would.

CRASH_AT=STATE: just before the store commits a RUNNING or SUSPENDED job's move to STATE. Used by
tests/integration/test_state_dir.py; the daemon otherwise runs unchanged.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from gpusched.daemon import store as _store
from gpusched.daemon.main import cli
from gpusched.model import Job, JobState

_transition = _store.Store.transition


def _crash_first(self: _store.Store, job: Job, new: JobState, **kwargs: Any) -> Job:
    if os.environ.get("CRASH_AT") == new.value and job.state in (JobState.RUNNING, JobState.SUSPENDED):
        os.kill(os.getpid(), signal.SIGKILL)
    return _transition(self, job, new, **kwargs)


if __name__ == "__main__":
    _store.Store.transition = _crash_first  # type: ignore[method-assign]
    sys.argv[0] = "gpuschedd"
    cli()
