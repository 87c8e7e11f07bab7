"""The read side of the state database: jobs, their histories, listings, events and metadata.

Kept apart from store.py so each file has one job: this reads (on the loop, or on a read-only
connection of its own in a worker thread); store.py writes, on the daemon's one connection.
"""

from __future__ import annotations

import os
import sqlite3
import urllib.parse
from collections.abc import Iterable, Iterator
from itertools import chain
from operator import attrgetter
from typing import Any, NamedTuple

from gpusched.daemon.arraystore import ArrayReads
from gpusched.daemon.compact import Compactor
from gpusched.daemon.envstore import EnvReader
from gpusched.model import (
    TERMINAL_STATES,
    Allocation,
    Event,
    Job,
    JobSpec,
    JobState,
    Transition,
    WholeRequest,
)


class SummaryRow(NamedTuple):
    """What a listing (`queue --all`) needs of a job, read without parsing its spec."""

    id: int
    uid: int
    user: str
    state: JobState
    submitted_at: float
    started_at: float | None
    ended_at: float | None
    exit_code: int | None
    reason: str
    devices: list[str]
    display: str
    request: str
    array_id: int | None = None
    array_task: int | None = None


# A stand-in for the spec where a reader asked for jobs without theirs (accounting needs times and
# allocations only, and parsing 256 KiB specs by the thousand is what made `stats` slow).
NO_SPEC = JobSpec(argv=["?"], cwd="/", request=WholeRequest(gpus=1))

_STATES = {s.value: s for s in JobState}  # a dict lookup, not Enum's __call__: a restart reads 200k
_JOB_ID = attrgetter("id")
_LOAD_CHUNK = 500  # rows read at a time when loading many jobs (at most SQLite's host-parameter limit)

_SUMMARY_COLUMNS = ("id, uid, user, state, submitted_at, started_at, ended_at, exit_code, reason, allocation, "
                    "display, request, array_id, array_task")
# An array task's spec is its array's (jobs.spec is '' for tasks), whose environment is inline: read
# once per chunk of rows for the arrays they name (_array_specs), as SQLite's own lookup for every row
# cost a sixth of reading 100k jobs even when none was a task.
_SPEC = "spec, env_id"


class StoreReader(ArrayReads):
    """The read side of the store. The daemon's Store is one; `StoreReader.open` gives a read-only
    connection of its own that a worker thread may use while the loop keeps serving (WAL readers
    never block the writer)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db
        self.compactor = Compactor()
        self.envs = EnvReader(db)

    @classmethod
    def open(cls, path: str) -> StoreReader:
        uri = f"file:{urllib.parse.quote(os.path.abspath(path))}?mode=ro"
        return cls(sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False))

    def close(self) -> None:
        self._db.close()

    def get(self, job_id: int) -> Job | None:
        rows = list(self._select("WHERE id = ?", (job_id,)))
        return rows[0] if rows else None

    def jobs_in(self, states: Iterable[JobState]) -> list[Job]:
        """Jobs in the given states, in submission order (the order pending jobs were acknowledged)."""
        # One state at a time, each in id order off the state index, then their runs merged by one
        # sort in C (heapq.merge took 3x as long at 100k jobs), where `state IN (...) ORDER BY id` had
        # SQLite sort every row, specs and all, in a temporary B-tree (a third of the reading).
        per_state = [self._select("WHERE state = ? ORDER BY id", (s.value,)) for s in sorted(set(states))]
        return sorted(chain.from_iterable(per_state), key=_JOB_ID)

    def jobs_touching(self, since: float, *, with_spec: bool = True) -> list[Job]:
        """Jobs not finished before `since` (unfinished ones included), in submission order.

        Without `with_spec` each job's spec is NO_SPEC: accounting reads only times and allocations.
        """
        return list(self._select("WHERE ended_at IS NULL OR ended_at >= ? ORDER BY id", (since,), with_spec))

    def waiting_totals(self) -> dict[int, tuple[int, int]]:
        """uid -> (PENDING and HELD jobs, their spec_bytes): a restart's per-user limit counts, summed
        by SQLite instead of measuring every queued spec in Python."""
        rows = self._db.execute("SELECT uid, COUNT(*), TOTAL(spec_bytes) FROM jobs WHERE state IN (?, ?) GROUP BY uid",
                                (JobState.PENDING.value, JobState.HELD.value))
        return {uid: (count, int(size)) for uid, count, size in rows}

    def owner(self, job_id: int) -> tuple[int, str, JobState] | None:
        """(uid, user, state) of a job, without reading its spec: enough to refuse or skip it cheaply."""
        row = self._db.execute("SELECT uid, user, state FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else (row[0], row[1], JobState(row[2]))

    def summaries(self, *, limit: int, after_id: int | None = None, user: str | None = None,
                  finished: bool = False, tasks: bool = True) -> list[SummaryRow]:
        """Listing rows in id order: the first `limit` above `after_id`, else the newest `limit`
        (only ended jobs with `finished`; no array tasks without `tasks`). Specs are never read: the
        columns hold what a row shows."""
        where, args = _listing_filter(after_id=after_id, user=user, finished=finished, tasks=tasks)
        order = "ASC" if after_id is not None else "DESC"
        rows = self._db.execute(f"SELECT {_SUMMARY_COLUMNS} FROM jobs {where} ORDER BY id {order} LIMIT ?",
                                (*args, limit)).fetchall()
        out = [
            SummaryRow(id=r[0], uid=r[1], user=r[2], state=JobState(r[3]), submitted_at=r[4], started_at=r[5],
                       ended_at=r[6], exit_code=r[7], reason=r[8],
                       devices=Allocation.model_validate_json(r[9]).uuids if r[9] else [], display=r[10] or "",
                       request=r[11] or "", array_id=r[12], array_task=r[13])
            for r in rows
        ]
        return out if after_id is not None else out[::-1]

    def count_summaries(self, *, user: str | None = None, finished: bool = False, tasks: bool = True) -> int:
        """How many rows `summaries` would list with no limit (what `queue --all` says is left out)."""
        where, args = _listing_filter(after_id=None, user=user, finished=finished, tasks=tasks)
        return int(self._db.execute(f"SELECT COUNT(*) FROM jobs {where}", args).fetchone()[0])

    def _select(self, where: str, args: tuple[Any, ...], with_spec: bool = True) -> Iterator[Job]:
        cur = self._db.execute(
            f"SELECT id, uid, gid, user, {_SPEC if with_spec else 'NULL, NULL'}, state, submitted_at, started_at,"
            f" ended_at, exit_code, signal, reason, allocation, pid, array_id, array_task FROM jobs {where}",
            args,
        )
        # In chunks: 100k rows of spec text held at once would be freed after the load, but would
        # leave the daemon's heap that much bigger for the rest of its life.
        while rows := cur.fetchmany(_LOAD_CHUNK):
            yield from self._jobs(rows, with_spec)

    def _jobs(self, rows: list[Any], with_spec: bool) -> Iterator[Job]:
        histories = self._histories({r[0]: r[7] for r in rows})
        compact = self.compactor  # an array's tasks share one spec: the text is its array's, the same for all
        envs = self.envs
        arrays = self._array_specs({r[15] for r in rows if r[15] is not None}) if with_spec else {}
        for r in rows:
            if not with_spec:
                spec = NO_SPEC
            elif r[15] is not None:
                spec = compact.spec_from_json(arrays[r[15]])
            else:
                spec = compact.spec_from_json(r[4], None if r[5] is None else envs.get(r[5]))
            yield compact.job(
                id=r[0], uid=r[1], gid=r[2], user=r[3], spec=spec, state=_STATES[r[6]],
                submitted_at=r[7], started_at=r[8], ended_at=r[9], exit_code=r[10], signal=r[11], reason=r[12],
                allocation=Allocation.model_validate_json(r[13]) if r[13] else None, pid=r[14],
                history=histories.get(r[0], []), array_id=r[15], array_task=r[16],
            )

    def _array_specs(self, ids: set[int]) -> dict[int, str]:
        """Array id -> the stored spec its tasks share."""
        if not ids:
            return {}
        marks = ", ".join("?" for _ in ids)
        return dict(self._db.execute(f"SELECT id, spec FROM arrays WHERE id IN ({marks})", tuple(ids)).fetchall())

    def _histories(self, submitted: dict[int, float]) -> dict[int, list[Transition]]:
        """Job id -> history, for the jobs in `submitted` (id -> submitted_at: a first transition no
        row stores is implied, schema.FIRST_REASON)."""
        out: dict[int, list[Transition]] = {}
        ids = list(submitted)
        for start in range(0, len(ids), 500):  # stay under SQLite's host-parameter limit
            chunk = ids[start : start + 500]
            marks = ", ".join("?" for _ in chunk)
            self.compactor.add_histories(self._db.execute(
                f"SELECT job_id, seq, state, at, reason FROM transitions WHERE job_id IN ({marks})"
                " ORDER BY job_id, seq", chunk,
            ), _STATES, out, submitted)
        if len(out) < len(submitted):  # (most queued jobs have no row at all)
            first = self.compactor.first_transition
            for job_id, at in submitted.items():
                if job_id not in out:
                    out[job_id] = [first(at)]
        return out

    def events(self, *, job_id: int | None = None, limit: int = 100) -> list[Event]:
        """The newest `limit` events (of one job, if given), oldest first."""
        where, args = ("WHERE job_id = ?", (job_id,)) if job_id is not None else ("", ())
        rows = self._db.execute(
            f"SELECT at, kind, message, gpu, device, job_id FROM events {where} ORDER BY id DESC LIMIT ?",
            (*args, limit),
        ).fetchall()
        return [Event(at=r[0], kind=r[1], message=r[2], gpu=r[3], device=r[4], job_id=r[5]) for r in reversed(rows)]

    def get_meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])


def _listing_filter(*, after_id: int | None, user: str | None, finished: bool, tasks: bool) -> tuple[str, list[Any]]:
    """The WHERE clause (and its arguments) of a listing: `summaries` and `count_summaries` alike."""
    clauses: list[str] = [] if tasks else ["array_id IS NULL"]
    args: list[Any] = []
    if after_id is not None:
        clauses.append("id > ?")
        args.append(after_id)
    if user is not None:
        clauses.append("user = ?")
        args.append(user)
    if finished:
        clauses.append(f"state IN ({', '.join('?' for _ in TERMINAL_STATES)})")
        args.extend(s.value for s in TERMINAL_STATES)
    return ("WHERE " + " AND ".join(clauses)) if clauses else "", args
