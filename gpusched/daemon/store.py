"""SQLite persistence (WAL). Every acknowledged change is committed before the daemon answers.

The store persists the model (jobs, their histories, scheduler standing), never runtime handles:
pids are kept only so that recovery can check them against the shim's records on the next start.
Illegal state transitions raise instead of being written, so a bug cannot corrupt a history.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from gpusched.arrayspec import ArraySpec
from gpusched.construct import construct, fields_of
from gpusched.daemon import retention, schema
from gpusched.daemon.arraystore import insert_array, insert_submit_key
from gpusched.daemon.envstore import store_env
from gpusched.daemon.storereader import NO_SPEC, StoreReader, SummaryRow
from gpusched.model import (
    TRANSITIONS,
    Allocation,
    Event,
    Job,
    JobSpec,
    JobState,
    Transition,
)

# The read side moved to storereader.py and the schema to schema.py; importers of the store keep their imports.
__all__ = ["NO_SPEC", "Store", "StoreError", "StoreReader", "SummaryRow"]

_UPDATABLE = frozenset({"started_at", "ended_at", "exit_code", "signal", "allocation", "pid", "reason"})


class StoreError(Exception):
    """The store refused a change (illegal transition, unknown job)."""


class Store(StoreReader):
    """One SQLite connection, used from the daemon's event-loop thread only."""

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
        self.path = path
        self._batching = False
        self._savepoints = 0
        self._riders: dict[str, str] = {}  # meta values for the next COMMIT (meta_with_next_commit)
        self._meta_committed: dict[str, str] = {}  # what riders last committed, by key
        super().__init__(sqlite3.connect(path, isolation_level=None, check_same_thread=False))
        os.chmod(path, 0o600)  # job specs hold users' environments; the WAL and SHM files inherit this
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # an ack means the change survives power loss
        self._db.execute("PRAGMA foreign_keys=ON")
        version = schema.version(self._db)
        if version is not None and version > schema.SCHEMA_VERSION:
            raise StoreError(
                f"{path}: database schema {version} is newer than this gpusched understands ({schema.SCHEMA_VERSION})"
            )
        schema.create_or_upgrade(self._db, version)

    def _tx(self) -> _Change:
        """One change, all or nothing: its own transaction, or inside `batch()` a savepoint (so a change
        that fails undoes only itself, and the batch's other changes still commit)."""
        return _Change(self)

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
            self._commit()

    @contextmanager
    def unsynced(self) -> Iterator[None]:
        """Changes committed without an fsync of their own, for what no client was told of: they are
        made durable by the next ordinary commit (the WAL's fsync covers every frame before it, and a
        power loss can only cut the WAL at a frame, never reorder it) and survive a kill -9 meanwhile
        (the page cache holds them). Inside a transaction already, they simply join it.

        NORMAL, not OFF: the two differ only in a checkpoint, which SQLite runs inside the commit that
        fills the WAL past its limit. Under OFF that checkpoint copied the WAL into the database file
        without syncing either, and the WAL was then written over from its start: a power loss
        could lose changes that had been acknowledged, durably, long before. Under NORMAL it syncs
        the WAL before and the database file after, as under FULL."""
        if self._db.in_transaction:
            yield
            return
        self._db.execute("PRAGMA synchronous=NORMAL")
        try:
            yield
        finally:
            self._db.execute("PRAGMA synchronous=FULL")

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
                self._rollback()
            raise
        else:
            self._commit()
        finally:
            self._batching = False
            self._savepoints -= 1

    def _commit(self) -> None:
        """COMMIT (with the meta values riding on it); if that fails, roll back what is left of the
        transaction and raise: the riders then wait for the next COMMIT."""
        riders = self._riders
        try:
            for key, value in riders.items():
                self._db.execute(_SET_META, (key, value, value))
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:
                self._rollback()
            raise
        if riders:
            self._meta_committed.update(riders)
            self._riders = {}

    def _rollback(self, savepoint: bool = False) -> None:
        """ROLLBACK (or to the change's savepoint). An environment's id inserted in what is undone
        can be handed out again, so the environments read since are forgotten (envstore.py)."""
        self._db.execute("ROLLBACK TO change" if savepoint else "ROLLBACK")
        self.envs.forget()

    # ---- jobs ------------------------------------------------------------------------------------

    def submit(self, *, uid: int, gid: int, user: str, spec: JobSpec, now: float, reason: str = schema.FIRST_REASON,
               hold: bool = False, request_id: str | None = None, size: int | None = None) -> Job:
        """Insert a PENDING job (HELD with `hold`) with its history, and its submit key, in one change;
        `size`: spec_bytes(spec), if the caller has measured it (the engine has, for the per-user limits)."""
        history = _first_history(now, reason, hold)
        compact = self.compactor
        apart = compact.stored_env(spec.env)  # (JSON, digest), stored once in envs; None: small, inline
        stored = (_SPEC_JSON(spec) if apart is None else _SPEC_JSON(spec, exclude={"env"})).decode()
        # Measured on the shared form the job will hold: the compactor's size table keeps what it
        # measures alive, and must not keep the request's own copy of every spec.
        shared = compact.spec(spec, stored, None if apart is None else apart[1])
        last = history[-1]
        with self._tx() as db:  # (a state's `_value_`: an enum's `value` is a property, a Python call each)
            env_id = None if apart is None else store_env(db, *apart)
            cur = db.execute(
                "INSERT INTO jobs (uid, gid, user, spec, state, submitted_at, reason, display, request, spec_bytes,"
                " env_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (uid, gid, user, stored, last.state._value_, now, last.reason, *compact.columns(shared, size), env_id),
            )
            job_id = cur.lastrowid
            assert job_id is not None
            for seq, t in schema.stored_transitions(history, now):  # (none for a plain submit)
                db.execute("INSERT INTO transitions (job_id, seq, state, at, reason) VALUES (?, ?, ?, ?, ?)",
                           (job_id, seq, t.state._value_, t.at, t.reason))
            if request_id is not None:
                insert_submit_key(db, uid, request_id, job_id)
        return compact.job(
            id=job_id, uid=uid, gid=gid, user=user, spec=shared, state=last.state,
            submitted_at=now, reason=last.reason, history=history,
        )

    def submit_array(self, *, uid: int, gid: int, user: str, spec: JobSpec, now: float, array: ArraySpec,
                     hold: bool = False, request_id: str | None = None) -> tuple[int, list[Job]]:
        """Insert a job array and all its tasks in one change; returns (array id, tasks in task order)."""
        history = _first_history(now, schema.FIRST_REASON, hold)
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

    def ids_start_after(self, highest: int) -> bool:
        """New job ids come after `highest` (the largest id that has files in the state directory).
        A database restored from a backup, or one that lost its WAL, would hand out again the ids of
        jobs it forgot, and with them those jobs' directories and logs. True if the sequence moved."""
        row = self._db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'jobs'").fetchone()
        if int(row[0] if row is not None else 0) >= highest:
            return False
        with self._tx() as db:
            if row is None:
                db.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('jobs', ?)", (highest,))
            else:
                db.execute("UPDATE sqlite_sequence SET seq = ? WHERE name = 'jobs'", (highest,))
        return True

    def prune_cutoff(self, keep: int) -> retention.Cutoff:
        """The newest finished job beyond the newest `keep` (retention.prune_cutoff), for a run of
        `prune_finished` calls to share."""
        return retention.prune_cutoff(self._db, keep)

    def prune_finished(self, *, ended_before: float, keep: int, protect: Iterable[int] = (),
                       batch: int = 500, cutoff: retention.Cutoff | None = None) -> list[int]:
        """Delete up to `batch` finished jobs (retention.prune_finished); the ids deleted."""
        return retention.prune_finished(self._db, self._tx, ended_before=ended_before, keep=keep, protect=protect,
                                        batch=batch, cutoff=cutoff)

    # ---- device and job events -------------------------------------------------------------------

    def add_event(self, event: Event) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO events (at, kind, message, gpu, device, job_id) VALUES (?, ?, ?, ?, ?, ?)",
                (event.at, event.kind, event.message, event.gpu, event.device, event.job_id),
            )

    # ---- metadata (scheduler standing, schema version) --------------------------------------------

    def set_meta(self, key: str, value: str) -> None:
        self._riders.pop(key, None)  # this newer value wins over one waiting to ride
        self._meta_committed.pop(key, None)
        with self._tx() as db:
            db.execute(_SET_META, (key, value, value))

    def meta_with_next_commit(self, values: dict[str, str]) -> None:
        """Write these meta values inside the next transaction that commits, whichever it is, so they
        are exactly as durable as it: the standing a scheduling pass charged its starts with rides on
        their STARTING commit (a commit and its fsync fewer on each start's path, and never one
        durable without the other). A value equal to the one this store last committed for its key
        is not written again."""
        for key, value in values.items():
            if self._meta_committed.get(key) == value:
                self._riders.pop(key, None)
            else:
                self._riders[key] = value

    @property
    def meta_waiting(self) -> bool:
        """Whether meta values wait for a COMMIT (`commit_meta` gives them one of their own)."""
        return bool(self._riders)

    def commit_meta(self) -> None:
        """Commit the meta values waiting for a COMMIT now (inside a batch: with it)."""
        if self._riders:
            with self.batch():
                pass


class _Change:
    """`Store._tx()`. A class rather than a generator-based context manager: group commit enters one
    per submit, and the generator's machinery cost more than the rest of the block around the INSERT."""

    __slots__ = ("_mode", "_store")

    def __init__(self, store: Store) -> None:
        self._store = store
        self._mode = 0  # 0: inside a change that undoes this one too, 1: a savepoint, 2: a transaction

    def __enter__(self) -> sqlite3.Connection:
        store = self._store
        if store._savepoints:  # already inside one: it undoes this change too if it fails (two fewer statements)
            return store._db
        if store._batching:
            store._db.execute("SAVEPOINT change")
            store._savepoints += 1
            self._mode = 1
        else:
            store._db.execute("BEGIN IMMEDIATE")
            self._mode = 2
        return store._db

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        store = self._store
        if self._mode == 0:
            return
        if self._mode == 1:
            store._savepoints -= 1
            if exc_type is not None:
                store._rollback(savepoint=True)
            store._db.execute("RELEASE change")
        elif exc_type is not None:
            store._rollback()
        else:
            store._commit()  # a COMMIT that fails leaves no transaction open behind it


_TRANSITION_SET = fields_of(Transition)
# What spec.model_dump_json() writes (as bytes), without its wrapper: 6k instructions of a submit's ~500k.
_SPEC_JSON = JobSpec.__pydantic_serializer__.to_json
_SET_META = "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = ?"


def _first_history(now: float, reason: str, hold: bool) -> list[Transition]:
    """A new job's history: PENDING, then HELD at once for `submit --hold` (one change, one commit).
    Built without validation: the values are the daemon's own (every submit makes one)."""
    history = [construct(Transition, _TRANSITION_SET, {"state": JobState.PENDING, "at": now, "reason": reason})]
    if hold:
        history.append(construct(Transition, _TRANSITION_SET, {"state": JobState.HELD, "at": now,
                                                               "reason": "held at submission"}))
    return history


def _encode(value: Any) -> Any:
    if isinstance(value, Allocation):
        return value.model_dump_json()
    if isinstance(value, dict):
        return json.dumps(value)
    return value
