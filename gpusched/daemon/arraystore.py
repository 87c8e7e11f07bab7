"""The job-array side of the store: the `arrays` table, array tasks in `jobs`, and submit keys.

Kept apart from store.py so each file has one job: the store keeps jobs and their histories; this
adds what arrays and idempotent submits need on top of the same connection and schema.
An array is one row of `arrays` (its spec stored once) plus one `jobs` row per task, whose own
spec is '' (readers take the array's). An array's id is drawn from the jobs' id sequence, so an
id names a job or an array, never both.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from typing import NamedTuple

from gpusched.arrayspec import ArraySpec
from gpusched.daemon.schema import stored_transitions, task_bytes
from gpusched.model import (
    TERMINAL_STATES,
    Job,
    JobSpec,
    Transition,
    describe_request,
    display_name,
)


class KnownRequest(Exception):
    """The submit's request_id was used before by the same user: the job it created is the answer
    (`ArrayStore.submit_key`), and this write must create nothing (the caller rolls it back)."""


def insert_submit_key(db: sqlite3.Connection, uid: int, key: str, job_id: int) -> None:
    """Record `key` as the request that created `job_id` (a job or an array). The table's primary
    key is what finds a retried submit, so a submit does not look its key up before writing it
    (a SELECT per submit); KnownRequest when the key is there already."""
    try:
        db.execute("INSERT INTO submit_keys (uid, key, job_id) VALUES (?, ?, ?)", (uid, key, job_id))
    except sqlite3.IntegrityError:
        raise KnownRequest(key) from None


class ArrayRow(NamedTuple):
    """A job array as stored: its spec text, size and %MAX, and whose it is."""

    id: int
    uid: int
    user: str
    spec: JobSpec
    tasks: str
    task_count: int
    max_running: int | None
    submitted_at: float


class ArrayReads:
    """Reads of arrays and submit keys; mixed into StoreReader (and so into Store)."""

    _db: sqlite3.Connection

    def arrays(self, ids: Iterable[int] | None = None) -> dict[int, ArrayRow]:
        """Arrays by id: the given ones, else those with an unfinished task (what the engine loads)."""
        if ids is None:
            terminal = [s.value for s in TERMINAL_STATES]
            rows = self._db.execute(
                "SELECT id, uid, user, spec, tasks, task_count, max_running, submitted_at FROM arrays WHERE id IN "
                f"(SELECT DISTINCT array_id FROM jobs WHERE array_id IS NOT NULL AND state NOT IN "
                f"({', '.join('?' for _ in terminal)}))", terminal).fetchall()
        else:
            wanted = list(dict.fromkeys(ids))
            rows = []
            for start in range(0, len(wanted), 500):
                chunk = wanted[start : start + 500]
                rows += self._db.execute(
                    "SELECT id, uid, user, spec, tasks, task_count, max_running, submitted_at FROM arrays "
                    f"WHERE id IN ({', '.join('?' for _ in chunk)})", chunk).fetchall()
        return {r[0]: ArrayRow(id=r[0], uid=r[1], user=r[2], spec=JobSpec.model_validate_json(r[3]), tasks=r[4],
                               task_count=r[5], max_running=r[6], submitted_at=r[7]) for r in rows}

    def array_counts(self, ids: Iterable[int]) -> dict[int, dict[str, int]]:
        """Array id -> state -> how many of its tasks are in that state."""
        out: dict[int, dict[str, int]] = {}
        wanted = list(dict.fromkeys(ids))
        for start in range(0, len(wanted), 500):
            chunk = wanted[start : start + 500]
            for array_id, state, count in self._db.execute(
                f"SELECT array_id, state, COUNT(*) FROM jobs WHERE array_id IN ({', '.join('?' for _ in chunk)}) "
                "GROUP BY array_id, state", chunk):
                out.setdefault(array_id, {})[state] = count
        return out

    def newest_arrays(self, *, limit: int, user: str | None = None) -> list[int]:
        """Ids of the newest `limit` arrays still kept (of one user, if given)."""
        where, args = ("WHERE user = ?", (user,)) if user is not None else ("", ())
        return [r[0] for r in self._db.execute(f"SELECT id FROM arrays {where} ORDER BY id DESC LIMIT ?",
                                               (*args, limit))]

    def task_job_id(self, array_id: int, task: int) -> int | None:
        """The job id of task `task` of array `array_id`, if the array has that task."""
        row = self._db.execute("SELECT id FROM jobs WHERE array_id = ? AND array_task = ?",
                               (array_id, task)).fetchone()
        return None if row is None else int(row[0])

    def task_ids(self, array_id: int, *, unfinished: bool = False) -> list[int]:
        """Job ids of an array's tasks in task order (only those not yet ended with `unfinished`)."""
        terminal = [s.value for s in TERMINAL_STATES]
        where = f" AND state NOT IN ({', '.join('?' for _ in terminal)})" if unfinished else ""
        return [r[0] for r in self._db.execute(f"SELECT id FROM jobs WHERE array_id = ?{where} ORDER BY array_task",
                                               (array_id, *(terminal if unfinished else ())))]

    def submit_key(self, uid: int, key: str) -> int | None:
        """The job (or array) id a submit with this request_id created, if one did (and is still kept)."""
        row = self._db.execute("SELECT job_id FROM submit_keys WHERE uid = ? AND key = ?", (uid, key)).fetchone()
        return None if row is None else int(row[0])


def insert_array(db: sqlite3.Connection, *, uid: int, gid: int, user: str, spec: JobSpec, now: float,
                 array: ArraySpec, history: list[Transition], request_id: str | None) -> tuple[int, list[Job]]:
    """Insert a job array and all its tasks (each with `history`) inside the caller's transaction;
    returns (array id, tasks in task order).

    The array takes the next id of the jobs' sequence and its tasks the ids after it, so `123`
    names the array and each task also has a plain job id of its own.
    """
    state, reason = history[-1].state, history[-1].reason
    display, request = display_name(spec), describe_request(spec.request)
    row = db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'jobs'").fetchone()
    array_id = (int(row[0]) if row is not None else 0) + 1
    ids = range(array_id + 1, array_id + 1 + array.count)
    db.execute("INSERT INTO arrays (id, uid, user, spec, tasks, task_count, max_running, submitted_at)"
               " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
               (array_id, uid, user, spec.model_dump_json(), array.text, array.count, array.max_running, now))
    size = task_bytes(spec, array.count)
    db.executemany(
        "INSERT INTO jobs (id, uid, gid, user, spec, state, submitted_at, reason, display, request, array_id,"
        " array_task, spec_bytes) VALUES (?, ?, ?, ?, '', ?, ?, ?, ?, ?, ?, ?, ?)",
        [(job_id, uid, gid, user, state.value, now, reason, display, request, array_id, task, size)
         for job_id, task in zip(ids, array.tasks, strict=True)])
    stored = stored_transitions(history, now)  # (none for a plain submit: a task's first is implied)
    db.executemany("INSERT INTO transitions (job_id, seq, state, at, reason) VALUES (?, ?, ?, ?, ?)",
                   [(job_id, seq, t.state.value, t.at, t.reason) for job_id in ids for seq, t in stored])
    if request_id is not None:
        insert_submit_key(db, uid, request_id, array_id)
    # Copies of one validated task: building 10,000 Jobs field by field (validated or not) costs ~9 us
    # each, a copy ~2 us; they share the spec object, as they share its row.
    first = Job(id=ids[0], uid=uid, gid=gid, user=user, spec=spec, state=state, submitted_at=now, reason=reason,
                history=list(history), array_id=array_id, array_task=array.tasks[0])
    tasks = [first] + [first.model_copy(update={"id": job_id, "array_task": task, "history": list(history)})
                       for job_id, task in zip(ids[1:], array.tasks[1:], strict=True)]
    return array_id, tasks
