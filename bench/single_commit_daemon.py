"""gpuschedd with group commit cut down to one write per COMMIT: bench_api's baseline for what group
commit itself buys.

The same daemon, the same code on every path, but each submit's write is committed, and fsynced,
alone before the next is written (GroupCommit with max_batch=1), as gpuschedd did before group
commit. Its rate next to the real daemon's, with the same clients on the same disk in the same run,
is group commit's own gain: the single-commit floor also moves with the daemon's CPU per submit, which
group commit does not change.

    python bench/single_commit_daemon.py --config ... --sim ... --socket ... --state-dir ...

takes gpuschedd's own options (`harness.DaemonProc(..., program=harness.SINGLE_COMMIT)` starts it).
Nothing in gpusched itself can be set to this: it is a benchmark's baseline, not a mode to run.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gpusched.daemon import engine
from gpusched.daemon.groupcommit import GroupCommit
from gpusched.daemon.main import cli
from gpusched.daemon.store import Store


class SingleCommit(GroupCommit):
    """Every write its own COMMIT: a batch never holds more than one."""

    def __init__(self, store: Store) -> None:
        super().__init__(store, max_batch=1)


if __name__ == "__main__":
    setattr(engine, "GroupCommit", SingleCommit)  # noqa: B010 - the name Engine builds its group commit from
    cli()
