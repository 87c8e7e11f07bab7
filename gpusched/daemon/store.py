"""SQLite persistence (WAL). Every acknowledged change is committed before the daemon answers.

The store persists the model (jobs, their histories, scheduler standing), never runtime handles:
pids are kept only so that recovery can check them against the shim's records on the next start.
Illegal state transitions raise instead of being written, so a bug cannot corrupt a history.
"""

from __future__ import annotations

import json
import os
import sqlite3
import urllib.parse
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

from gpusched.arrayspec import ArraySpec
from gpusched.daemon.arraystore import ArrayReads, insert_array
from gpusched.daemon.compact import Compactor
from gpusched.model import (
    TERMINAL_STATES,
    TRANSITIONS,
    Allocation,
    Event,
    Job,
    JobSpec,
    JobState,
    Transition,
    WholeRequest,
    describe_request,
    display_name,
)

SCHEMA_VERSION = 3  # 2: jobs.display and jobs.request, so listings never parse a spec; 3: job arrays, submit keys

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    uid INTEGER NOT NULL,
    gid INTEGER NOT NULL,
    user TEXT NOT NULL,
    spec TEXT NOT NULL,
    state TEXT NOT NULL,
    submitted_at REAL NOT NULL,
    started_at REAL,
    ended_at REAL,
    exit_code INTEGER,
    signal INTEGER,
    reason TEXT NOT NULL DEFAULT '',
    allocation TEXT,
    pid INTEGER,
    display TEXT,
    request TEXT,
    array_id INTEGER,
    array_task INTEGER
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state);
-- One row per job array; its tasks are rows of `jobs` (array_id, array_task) whose own spec is ''
-- (they all share this one: 10,000 tasks must not store 10,000 copies of a 256 KiB environment).
-- An array's id comes from the jobs' id sequence, so an id names a job or an array, never both.
CREATE TABLE IF NOT EXISTS arrays (
    id INTEGER PRIMARY KEY,
    uid INTEGER NOT NULL,
    user TEXT NOT NULL,
    spec TEXT NOT NULL,
    tasks TEXT NOT NULL,
    task_count INTEGER NOT NULL,
    max_running INTEGER,
    submitted_at REAL NOT NULL
);
-- Client-chosen idempotency keys of submits (`request_id`): a retried submit finds its job here.
CREATE TABLE IF NOT EXISTS submit_keys (
    uid INTEGER NOT NULL,
    key TEXT NOT NULL,
    job_id INTEGER NOT NULL,
    PRIMARY KEY (uid, key)
);
CREATE TABLE IF NOT EXISTS transitions (
    job_id INTEGER NOT NULL REFERENCES jobs(id),
    seq INTEGER NOT NULL,
    state TEXT NOT NULL,
    at REAL NOT NULL,
    reason TEXT NOT NULL,
    PRIMARY KEY (job_id, seq)
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    kind TEXT NOT NULL,
    message TEXT NOT NULL,
    gpu INTEGER,
    device TEXT,
    job_id INTEGER
);
CREATE INDEX IF NOT EXISTS events_job ON events(job_id);
"""

_UPDATABLE = frozenset({"started_at", "ended_at", "exit_code", "signal", "allocation", "pid"})


class StoreError(Exception):
    """The store refused a change (illegal transition, unknown job)."""


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
_LOAD_CHUNK = 500  # rows read at a time when loading many jobs (at most SQLite's host-parameter limit)

_SUMMARY_COLUMNS = ("id, uid, user, state, submitted_at, started_at, ended_at, exit_code, reason, allocation, "
                    "display, request, array_id, array_task")
# An array task's spec is its array's (jobs.spec is '' for tasks).
_SPEC = "CASE WHEN array_id IS NULL THEN spec ELSE (SELECT a.spec FROM arrays a WHERE a.id = jobs.array_id) END"


class StoreReader(ArrayReads):
    """The read side of the store. The daemon's Store is one; `StoreReader.open` gives a read-only
    connection of its own that a worker thread may use while the loop keeps serving (WAL readers
    never block the writer)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db
        self.compactor = Compactor()

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
        names = [s.value for s in states]
        marks = ", ".join("?" for _ in names)
        return list(self._select(f"WHERE state IN ({marks}) ORDER BY id", tuple(names)))

    def jobs_touching(self, since: float, *, with_spec: bool = True) -> list[Job]:
        """Jobs not finished before `since` (unfinished ones included), in submission order.

        Without `with_spec` each job's spec is NO_SPEC: accounting reads only times and allocations.
        """
        return list(self._select("WHERE ended_at IS NULL OR ended_at >= ? ORDER BY id", (since,), with_spec))

    def owner(self, job_id: int) -> tuple[int, str, JobState] | None:
        """(uid, user, state) of a job, without reading its spec: enough to refuse or skip it cheaply."""
        row = self._db.execute("SELECT uid, user, state FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else (row[0], row[1], JobState(row[2]))

    def summaries(self, *, limit: int, after_id: int | None = None, user: str | None = None,
                  finished: bool = False, tasks: bool = True) -> list[SummaryRow]:
        """Listing rows in id order: the first `limit` above `after_id`, else the newest `limit`
        (only ended jobs with `finished`; no array tasks without `tasks`). Specs are never read: the
        columns hold what a row shows."""
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
        where = ("WHERE " + " AND ".join(clauses)) if clauses else ""
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

    def _select(self, where: str, args: tuple[Any, ...], with_spec: bool = True) -> Iterator[Job]:
        cur = self._db.execute(
            f"SELECT id, uid, gid, user, {_SPEC if with_spec else 'NULL'}, state, submitted_at, started_at, ended_at,"
            f" exit_code, signal, reason, allocation, pid, array_id, array_task FROM jobs {where}",
            args,
        )
        # In chunks: 100k rows of spec text held at once would be freed after the load, but would
        # leave the daemon's heap that much bigger for the rest of its life.
        while rows := cur.fetchmany(_LOAD_CHUNK):
            yield from self._jobs(rows, with_spec)

    def _jobs(self, rows: list[Any], with_spec: bool) -> Iterator[Job]:
        histories = self._histories([r[0] for r in rows])
        compact = self.compactor  # an array's tasks share one spec: the text is its array's, the same for all
        for r in rows:
            yield compact.job(
                id=r[0], uid=r[1], gid=r[2], user=r[3],
                spec=compact.spec_from_json(r[4]) if with_spec else NO_SPEC, state=_STATES[r[5]],
                submitted_at=r[6], started_at=r[7], ended_at=r[8], exit_code=r[9], signal=r[10], reason=r[11],
                allocation=Allocation.model_validate_json(r[12]) if r[12] else None, pid=r[13],
                history=histories.get(r[0], []), array_id=r[14], array_task=r[15],
            )

    def _histories(self, ids: list[int]) -> dict[int, list[Transition]]:
        out: dict[int, list[Transition]] = {}
        for start in range(0, len(ids), 500):  # stay under SQLite's host-parameter limit
            chunk = ids[start : start + 500]
            marks = ", ".join("?" for _ in chunk)
            for job_id, state, at, reason in self._db.execute(
                f"SELECT job_id, state, at, reason FROM transitions WHERE job_id IN ({marks}) ORDER BY job_id, seq",
                chunk,
            ):
                out.setdefault(job_id, []).append(self.compactor.transition(_STATES[state], at, reason))
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


class Store(StoreReader):
    """One SQLite connection, used from the daemon's event-loop thread only."""

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
        self.path = path
        self._batching = False
        self._savepoints = 0
        super().__init__(sqlite3.connect(path, isolation_level=None, check_same_thread=False))
        os.chmod(path, 0o600)  # job specs hold users' environments; the WAL and SHM files inherit this
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # an ack means the change survives power loss
        self._db.execute("PRAGMA foreign_keys=ON")
        version = self.get_meta("schema_version") if self._has_table("meta") else None
        if version is not None and int(version) > SCHEMA_VERSION:
            raise StoreError(
                f"{path}: database schema {version} is newer than this gpusched understands ({SCHEMA_VERSION})"
            )
        self._db.executescript(_SCHEMA)
        self._upgrade()
        self.set_meta("schema_version", str(SCHEMA_VERSION))

    def _has_table(self, name: str) -> bool:
        return self._db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
                                (name,)).fetchone() is not None

    def _upgrade(self) -> None:
        """Schema 1 -> 2: add the listing columns and fill them in from the specs (once).
        Schema 2 -> 3: the array columns (NULL: not a task) and their index; the new tables are in _SCHEMA."""
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(jobs)")}
        for column, kind in (("display", "TEXT"), ("request", "TEXT"), ("array_id", "INTEGER"),
                             ("array_task", "INTEGER")):
            if column not in columns:
                self._db.execute(f"ALTER TABLE jobs ADD COLUMN {column} {kind}")
        self._db.execute("CREATE INDEX IF NOT EXISTS jobs_array ON jobs(array_id, array_task) "
                         "WHERE array_id IS NOT NULL")
        while True:
            rows = self._db.execute("SELECT id, spec FROM jobs WHERE display IS NULL LIMIT 500").fetchall()
            if not rows:
                return
            with self._tx() as db:
                for job_id, text in rows:
                    spec = JobSpec.model_validate_json(text)
                    db.execute("UPDATE jobs SET display = ?, request = ? WHERE id = ?",
                               (display_name(spec), describe_request(spec.request), job_id))

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One change, all or nothing: its own transaction, or inside `batch()` a savepoint (so a change
        that fails undoes only itself, and the batch's other changes still commit)."""
        if self._savepoints:  # already inside one: it undoes this change too if it fails (two fewer statements)
            yield self._db
            return
        if self._batching:
            self._db.execute("SAVEPOINT change")
            self._savepoints += 1
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK TO change")
                self._db.execute("RELEASE change")
                raise
            finally:
                self._savepoints -= 1
            self._db.execute("RELEASE change")
            return
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    @contextmanager
    def savepoint(self) -> Iterator[None]:
        """Inside `batch()`: several changes that stand or fall together (a group commit's one write)."""
        assert self._batching, "a savepoint belongs in a batch"
        with self._tx():
            yield

    @property
    def batching(self) -> bool:
        return self._batching

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Many changes, one COMMIT (one fsync): group commit, and cancelling a whole array.

        Every change made inside is committed when the block ends, even when a later one raised:
        each change is applied in memory only after its own write succeeded, so committing exactly
        the successful ones keeps the store and the engine's mirror equal. Nested batches join the
        outer one. Nothing written inside is durable before the block has ended.
        """
        if self._batching:
            yield
            return
        self._db.execute("BEGIN IMMEDIATE")
        self._batching = True
        try:
            yield
        finally:
            self._batching = False
            try:
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise

    @contextmanager
    def batch_or_nothing(self) -> Iterator[None]:
        """Many changes, one COMMIT, and no savepoint per change (two statements fewer each: a fifth
        of a submit's SQL): an exception out of the block rolls every change back and is re-raised.
        Group commit tries this first and falls back to `batch()` when one of its writes fails."""
        assert not self._batching, "an all-or-nothing batch cannot join another batch"
        self._db.execute("BEGIN IMMEDIATE")
        self._batching = True
        self._savepoints += 1  # the whole transaction is every change's savepoint
        try:
            yield
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise
        else:
            try:
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
        finally:
            self._batching = False
            self._savepoints -= 1

    # ---- jobs ------------------------------------------------------------------------------------

    def submit(self, *, uid: int, gid: int, user: str, spec: JobSpec, now: float, reason: str = "submitted",
               hold: bool = False, request_id: str | None = None) -> Job:
        """Insert a PENDING job (HELD with `hold`) with its history, and its submit key, in one change."""
        history = _first_history(now, reason, hold)
        stored = spec.model_dump_json()
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO jobs (uid, gid, user, spec, state, submitted_at, reason, display, request)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (uid, gid, user, stored, history[-1].state.value, now, history[-1].reason,
                 display_name(spec), describe_request(spec.request)),
            )
            job_id = cur.lastrowid
            assert job_id is not None
            for seq, t in enumerate(history):
                db.execute("INSERT INTO transitions (job_id, seq, state, at, reason) VALUES (?, ?, ?, ?, ?)",
                           (job_id, seq, t.state.value, t.at, t.reason))
            if request_id is not None:
                db.execute("INSERT INTO submit_keys (uid, key, job_id) VALUES (?, ?, ?)", (uid, request_id, job_id))
        compact = self.compactor
        return compact.job(
            id=job_id, uid=uid, gid=gid, user=user, spec=compact.spec(spec, stored), state=history[-1].state,
            submitted_at=now, reason=history[-1].reason, history=history,
        )

    def submit_array(self, *, uid: int, gid: int, user: str, spec: JobSpec, now: float, array: ArraySpec,
                     hold: bool = False, request_id: str | None = None) -> tuple[int, list[Job]]:
        """Insert a job array and all its tasks in one change; returns (array id, tasks in task order)."""
        history = _first_history(now, "submitted", hold)
        with self._tx() as db:
            return insert_array(db, uid=uid, gid=gid, user=user, spec=spec, now=now, array=array, history=history,
                                request_id=request_id)

    def transition(self, job: Job, new: JobState, *, now: float, reason: str, **fields: Any) -> Job:
        """Commit `job -> new` with its reason, plus column updates; returns the updated job."""
        if new not in TRANSITIONS[job.state]:
            raise StoreError(f"job {job.id}: illegal transition {job.state} -> {new} ({reason})")
        unknown = set(fields) - _UPDATABLE
        if unknown:
            raise StoreError(f"job {job.id}: cannot update {sorted(unknown)}")
        columns = {k: _encode(v) for k, v in fields.items()}
        assignments = ", ".join(f"{k} = ?" for k in columns)
        with self._tx() as db:
            db.execute(
                f"UPDATE jobs SET state = ?, reason = ?{', ' + assignments if assignments else ''} WHERE id = ?",
                (new.value, reason, *columns.values(), job.id),
            )
            db.execute(
                "INSERT INTO transitions (job_id, seq, state, at, reason) VALUES (?, ?, ?, ?, ?)",
                (job.id, len(job.history), new.value, now, reason),
            )
        updated = job.model_copy(
            update={**fields, "state": new, "reason": reason,
                    "history": [*job.history, Transition(state=new, at=now, reason=reason)]}
        )
        return updated

    def update(self, job: Job, **fields: Any) -> Job:
        """Change columns without a state change (e.g. the pid once the shim reports it)."""
        unknown = set(fields) - _UPDATABLE
        if unknown:
            raise StoreError(f"job {job.id}: cannot update {sorted(unknown)}")
        columns = {k: _encode(v) for k, v in fields.items()}
        with self._tx() as db:
            db.execute(
                f"UPDATE jobs SET {', '.join(f'{k} = ?' for k in columns)} WHERE id = ?", (*columns.values(), job.id)
            )
        return job.model_copy(update=fields)

    def prune_finished(self, *, ended_before: float, keep: int, protect: Iterable[int] = (),
                       batch: int = 500) -> list[int]:
        """Delete up to `batch` finished jobs (with their transitions and events) that ended before
        `ended_before` or are beyond the newest `keep` finished ones; never those in `protect` (the
        targets of pending `--after` dependencies), nor the tasks of an array in `protect`. Returns
        the ids deleted; call again until empty.
        Small batches keep each write transaction short, so the loop's own commits never wait long."""
        terminal = [s.value for s in TERMINAL_STATES]
        marks = ", ".join("?" for _ in terminal)
        protected = set(protect)
        cutoff = self._db.execute(f"SELECT id FROM jobs WHERE state IN ({marks}) ORDER BY id DESC LIMIT 1 OFFSET ?",
                                  (*terminal, keep)).fetchone() if keep >= 0 else None
        newest_doomed = cutoff[0] if cutoff is not None else 0  # this id and older are beyond `keep`
        # A protected array id protects its tasks (`--after ARRAY` reads how they ended): left out in SQL,
        # so that 10,000 of them cannot fill every batch and stop the pruning of everything else.
        candidates = self._db.execute(
            f"SELECT id FROM jobs WHERE state IN ({marks}) AND (ended_at < ? OR id <= ?) AND (array_id IS NULL OR "
            "array_id NOT IN (SELECT value FROM json_each(?))) ORDER BY id LIMIT ?",
            (*terminal, ended_before, newest_doomed, json.dumps(sorted(protected)), batch + len(protected)),
        ).fetchall()
        ids = [r[0] for r in candidates if r[0] not in protected][:batch]
        if not ids:
            return []
        id_marks = ", ".join("?" for _ in ids)
        with self._tx() as db:
            arrays = [r[0] for r in db.execute(
                f"SELECT DISTINCT array_id FROM jobs WHERE id IN ({id_marks}) AND array_id IS NOT NULL", ids)]
            db.execute(f"DELETE FROM transitions WHERE job_id IN ({id_marks})", ids)
            db.execute(f"DELETE FROM events WHERE job_id IN ({id_marks})", ids)
            db.execute(f"DELETE FROM jobs WHERE id IN ({id_marks})", ids)
            db.execute(f"DELETE FROM submit_keys WHERE job_id IN ({id_marks})", ids)
            for array_id in arrays:  # an array goes with its last task (and its submit key with it)
                if db.execute("SELECT 1 FROM jobs WHERE array_id = ? LIMIT 1", (array_id,)).fetchone() is None:
                    db.execute("DELETE FROM arrays WHERE id = ?", (array_id,))
                    db.execute("DELETE FROM submit_keys WHERE job_id = ?", (array_id,))
        return ids

    # ---- device and job events -------------------------------------------------------------------

    def add_event(self, event: Event) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO events (at, kind, message, gpu, device, job_id) VALUES (?, ?, ?, ?, ?, ?)",
                (event.at, event.kind, event.message, event.gpu, event.device, event.job_id),
            )

    # ---- metadata (scheduler standing, schema version) --------------------------------------------

    def set_meta(self, key: str, value: str) -> None:
        with self._tx() as db:
            db.execute("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = ?",
                       (key, value, value))


def _first_history(now: float, reason: str, hold: bool) -> list[Transition]:
    """A new job's history: PENDING, then HELD at once for `submit --hold` (one change, one commit)."""
    history = [Transition(state=JobState.PENDING, at=now, reason=reason)]
    if hold:
        history.append(Transition(state=JobState.HELD, at=now, reason="held at submission"))
    return history


def _encode(value: Any) -> Any:
    if isinstance(value, Allocation):
        return value.model_dump_json()
    if isinstance(value, dict):
        return json.dumps(value)
    return value
