"""The state database's schema: its tables, its version, and the upgrades from older versions.

Kept apart from store.py so each file has one job: the store reads and writes jobs; this says what
the database looks like and brings an older one up to date, once, when the daemon opens it.
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager

from gpusched.model import JobSpec, JobState, Transition, describe_request, display_name, spec_bytes

SCHEMA_VERSION = 6  # 2: jobs.display and jobs.request, so listings never parse a spec; 3: job arrays, submit keys;
# 4: jobs.spec_bytes, so a restart sums the per-user byte limits in SQL instead of measuring 100k specs;
# 5: envs, each large environment stored once (envstore.py), and jobs.env_id
# 6: a job's first transition, PENDING at its submitted_at for the reason FIRST_REASON, is implied
# when its seq 0 row is absent (a submit writes one row fewer: `stored_transitions`)
FIRST_REASON = "submitted"  # why a submitted job is PENDING: its first transition, which no row stores

SCHEMA = """
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
    array_task INTEGER,
    spec_bytes INTEGER,  -- what it counts against max_pending_bytes_per_user (a task: its share of the array's)
    env_id INTEGER  -- the job's environment, in envs (its spec then has no env); NULL: inside the spec
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state);
-- Finished jobs by when they ended (pruning keeps the newest): partial, so a submit adds nothing to it.
CREATE INDEX IF NOT EXISTS jobs_ended ON jobs(ended_at, id) WHERE ended_at IS NOT NULL;
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
-- Environments of more than envstore.INLINE_MAX bytes, once each, by the digest of their JSON; never
-- an id twice (AUTOINCREMENT), as readers keep them parsed by id.
CREATE TABLE IF NOT EXISTS envs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    digest BLOB NOT NULL UNIQUE,
    env TEXT NOT NULL
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


def version(db: sqlite3.Connection) -> int | None:
    """The schema version a database was last written with; None for a new (empty) one."""
    if db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'").fetchone() is None:
        return None
    row = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    return None if row is None else int(row[0])


def create_or_upgrade(db: sqlite3.Connection, found: int | None) -> None:
    """Create what is missing, upgrade what is older, and record SCHEMA_VERSION (the caller has
    refused a newer database already). `found`: the version the database had (`version`), None for
    a new one. `_fill_in` reads every row, so a database already at SCHEMA_VERSION skips it (each of
    its queries was a full scan at every start: ~20 ms at 100k jobs).

    Schema 1 -> 2: add the listing columns and fill them in from the specs (once).
    Schema 2 -> 3: the array columns (NULL: not a task) and their index; the new tables are in SCHEMA.
    Schema 3 -> 4: jobs.spec_bytes, measured once from each job's spec (a task's from its array's).
    Schema 4 -> 5: the envs table and jobs.env_id; every existing row keeps its environment inline.
    Schema 5 -> 6: nothing to change (older seq 0 rows read as they always did); a daemon of schema 5
    would read histories without their implied first transition, so it refuses this database."""
    db.executescript(SCHEMA)
    columns = {row[1] for row in db.execute("PRAGMA table_info(jobs)")}
    for column, kind in (("display", "TEXT"), ("request", "TEXT"), ("array_id", "INTEGER"),
                         ("array_task", "INTEGER"), ("spec_bytes", "INTEGER"), ("env_id", "INTEGER")):
        if column not in columns:
            db.execute(f"ALTER TABLE jobs ADD COLUMN {column} {kind}")
    db.execute("CREATE INDEX IF NOT EXISTS jobs_array ON jobs(array_id, array_task) WHERE array_id IS NOT NULL")
    # pruning asks whether any job still names an environment
    db.execute("CREATE INDEX IF NOT EXISTS jobs_env ON jobs(env_id) WHERE env_id IS NOT NULL")
    if found is None or found < SCHEMA_VERSION:  # (a new database's tables are empty: nothing to scan)
        _fill_in(db)
    db.execute("INSERT INTO meta (key, value) VALUES ('schema_version', ?) ON CONFLICT(key) DO UPDATE SET value = ?",
               (str(SCHEMA_VERSION), str(SCHEMA_VERSION)))


def _fill_in(db: sqlite3.Connection) -> None:
    """The columns older schemas lacked, filled in from each row's spec (schemas 2 and 4)."""
    while rows := db.execute("SELECT id, spec FROM jobs WHERE display IS NULL LIMIT 500").fetchall():
        with _transaction(db):  # 500 rows per transaction: a big upgrade is not one huge one
            for job_id, text in rows:
                spec = JobSpec.model_validate_json(text)
                db.execute("UPDATE jobs SET display = ?, request = ? WHERE id = ?",
                           (display_name(spec), describe_request(spec.request), job_id))
    while rows := db.execute("SELECT id, spec FROM jobs WHERE spec_bytes IS NULL AND array_id IS NULL "
                             "LIMIT 500").fetchall():
        with _transaction(db):
            db.executemany("UPDATE jobs SET spec_bytes = ? WHERE id = ?",
                           [(spec_bytes(JobSpec.model_validate_json(text)), job_id) for job_id, text in rows])
    arrays = db.execute("SELECT id, spec, task_count FROM arrays WHERE id IN "
                        "(SELECT DISTINCT array_id FROM jobs WHERE spec_bytes IS NULL AND array_id IS NOT NULL)")
    for array_id, text, count in arrays.fetchall():
        with _transaction(db):
            db.execute("UPDATE jobs SET spec_bytes = ? WHERE array_id = ? AND spec_bytes IS NULL",
                       (task_bytes(JobSpec.model_validate_json(text), count), array_id))


def stored_transitions(history: list[Transition], submitted_at: float) -> list[tuple[int, Transition]]:
    """The (seq, transition) rows a new job's `history` is stored as: all of it but a first
    transition that is implied (PENDING at `submitted_at` for FIRST_REASON, as readers rebuild it).
    A plain submit stores none: one INSERT, and two B-trees, fewer in its transaction."""
    first = history[0] if history else None
    implied = (first is not None and first.state is JobState.PENDING and first.at == submitted_at
               and first.reason == FIRST_REASON)
    rows = list(enumerate(history))
    return rows[1:] if implied else rows


def task_bytes(spec: JobSpec, count: int) -> int:
    """What one of an array's `count` tasks counts against max_pending_bytes_per_user: its share of the
    one spec they all use (the engine's Arrays.held_bytes is the same figure)."""
    return math.ceil(spec_bytes(spec) / count)


@contextmanager
def _transaction(db: sqlite3.Connection) -> Iterator[None]:
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")
