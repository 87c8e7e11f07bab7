"""Retention: which finished jobs leave the store, and what goes with them.

Kept apart from store.py (its writes of live jobs): pruning reads the finished jobs' order and the
`--after` targets that must stay, and deletes a job's rows in every table that names it (its
transitions, events, submit key, its array's row with the last task, an environment with the last
job naming it), a few hundred jobs to a transaction so the loop's own commits never wait long.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager

from gpusched.daemon.envstore import prune_envs
from gpusched.model import TERMINAL_STATES

# A time-sensitive query's plan, pinned: given `state IN (...)`, SQLite preferred the jobs_state index
# and sorted every finished job in a temporary B-tree, ~60-120 ms a query at 79k finished jobs, each
# on the event loop (INDEXED BY raises instead if the index ever stops serving these queries).
_TERMINAL = tuple(s.value for s in TERMINAL_STATES)
_FINISHED = (f"FROM jobs INDEXED BY jobs_ended WHERE ended_at IS NOT NULL "
             f"AND state IN ({', '.join('?' for _ in _TERMINAL)})")
Cutoff = tuple[float, int]  # (ended_at, id) of the newest finished job `keep` leaves to pruning


def prune_cutoff(db: sqlite3.Connection, keep: int) -> Cutoff:
    """The newest finished job beyond the newest `keep` ones (it and all that ended before it may
    go); (-inf, 0) when `keep` finished jobs or fewer exist, or `keep` is negative. It walks `keep`
    entries of the index (~30 ms at keep = 10,000 here), so a run of batches works it out once: jobs
    that end meanwhile only make a fresh cutoff newer, so a stale one prunes less, never more."""
    # The newest `keep` are the last to have ended (not the highest ids: a two-day job that ends
    # after a sweep of short ones must not lose its record and log to them at once).
    cutoff = db.execute(f"SELECT ended_at, id {_FINISHED} ORDER BY ended_at DESC, id DESC LIMIT 1 OFFSET ?",
                        (*_TERMINAL, keep)).fetchone() if keep >= 0 else None
    return (cutoff[0], cutoff[1]) if cutoff is not None else (float("-inf"), 0)


def prune_finished(db: sqlite3.Connection, change: Callable[[], AbstractContextManager[sqlite3.Connection]], *,
                   ended_before: float, keep: int, protect: Iterable[int] = (), batch: int = 500,
                   cutoff: Cutoff | None = None) -> list[int]:
    """Delete up to `batch` finished jobs (with their transitions and events) that ended before
    `ended_before` or are beyond the newest `keep` finished ones; never those in `protect` (the
    targets of pending `--after` dependencies), nor, of an array in `protect`, one task of each
    state its tasks ended in (all `--after ARRAY` reads). Returns the ids deleted; call again until
    empty. `change`: the store's own transaction (Store._tx). Small batches keep each write
    transaction short, so the loop's own commits never wait long. `cutoff`: `prune_cutoff(db, keep)`
    worked out once for a run of calls (else each call works it out)."""
    protected = set(protect)
    doomed_end, doomed_id = cutoff if cutoff is not None else prune_cutoff(db, keep)  # this one and older go
    # `--after ARRAY` reads how the array ended from the set of states its tasks ended in
    # (engine_core._dependency_status), so a protected array keeps one task per state, not all of
    # them: one held job's 64 `--after` slots could otherwise keep 64 arrays of 10,001 tasks.
    protected |= {row[0] for row in db.execute(
        "SELECT MIN(id) FROM jobs WHERE array_id IN (SELECT value FROM json_each(?)) GROUP BY array_id, state",
        (json.dumps(sorted(protected)),))}
    candidates = db.execute(
        f"SELECT id {_FINISHED} AND (ended_at < ? OR (ended_at, id) <= (?, ?)) ORDER BY ended_at, id LIMIT ?",
        (*_TERMINAL, ended_before, doomed_end, doomed_id, batch + len(protected)),
    ).fetchall()
    ids = [r[0] for r in candidates if r[0] not in protected][:batch]
    if not ids:
        return []
    id_marks = ", ".join("?" for _ in ids)
    with change():  # one transaction (a savepoint inside a batch)
        arrays = [r[0] for r in db.execute(
            f"SELECT DISTINCT array_id FROM jobs WHERE id IN ({id_marks}) AND array_id IS NOT NULL", ids)]
        envs = [r[0] for r in db.execute(
            f"SELECT DISTINCT env_id FROM jobs WHERE id IN ({id_marks}) AND env_id IS NOT NULL", ids)]
        db.execute(f"DELETE FROM transitions WHERE job_id IN ({id_marks})", ids)
        db.execute(f"DELETE FROM events WHERE job_id IN ({id_marks})", ids)
        db.execute(f"DELETE FROM jobs WHERE id IN ({id_marks})", ids)
        db.execute(f"DELETE FROM submit_keys WHERE job_id IN ({id_marks})", ids)
        for array_id in arrays:  # an array goes with its last task (and its submit key with it)
            if db.execute("SELECT 1 FROM jobs WHERE array_id = ? LIMIT 1", (array_id,)).fetchone() is None:
                db.execute("DELETE FROM arrays WHERE id = ?", (array_id,))
                db.execute("DELETE FROM submit_keys WHERE job_id = ?", (array_id,))
        prune_envs(db, envs)  # an environment goes with the last job that names it
    return ids

