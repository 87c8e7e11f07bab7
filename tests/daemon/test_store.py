"""The store's listing columns and pruning, and the upgrade of a schema-1 database (real SQLite files)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from gpusched.arrayspec import parse_array_spec
from gpusched.daemon.schema import SCHEMA_VERSION
from gpusched.daemon.store import Store, StoreReader
from gpusched.model import JobSpec, JobState, WholeRequest, spec_bytes

_SCHEMA_1 = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE jobs (id INTEGER PRIMARY KEY AUTOINCREMENT, uid INTEGER NOT NULL, gid INTEGER NOT NULL,
    user TEXT NOT NULL, spec TEXT NOT NULL, state TEXT NOT NULL, submitted_at REAL NOT NULL, started_at REAL,
    ended_at REAL, exit_code INTEGER, signal INTEGER, reason TEXT NOT NULL DEFAULT '', allocation TEXT, pid INTEGER);
CREATE TABLE transitions (job_id INTEGER NOT NULL REFERENCES jobs(id), seq INTEGER NOT NULL, state TEXT NOT NULL,
    at REAL NOT NULL, reason TEXT NOT NULL, PRIMARY KEY (job_id, seq));
CREATE TABLE events (id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, kind TEXT NOT NULL,
    message TEXT NOT NULL, gpu INTEGER, device TEXT, job_id INTEGER);
INSERT INTO meta VALUES ('schema_version', '1');
"""


def _spec(program: str, name: str | None = None) -> JobSpec:
    return JobSpec(argv=[program], cwd="/tmp", request=WholeRequest(gpus=2), name=name)


def test_max_finished_jobs_keeps_the_last_to_end_not_the_highest_ids(tmp_path: Path) -> None:
    """A long job (the lowest id) that ends after a sweep of short ones is the newest finished job:
    pruning by id deleted it, and its log, at once (retention audit)."""
    store = Store(str(tmp_path / "gpusched.db"))
    jobs = [store.submit(uid=1, gid=1, user="u", spec=_spec(f"/bin/p{i}"), now=0.0) for i in range(4)]
    for job, ended in zip(jobs, (100.0, 50.0, 60.0, 70.0), strict=True):
        store.transition(job, JobState.CANCELLED, now=ended, reason="cancelled", ended_at=ended)
    assert store.prune_finished(ended_before=0.0, keep=2) == [jobs[1].id, jobs[2].id]
    assert store.get(jobs[0].id) is not None and store.get(jobs[3].id) is not None
    store.close()


def _finished(store: Store, count: int, first_end: float) -> list[int]:
    jobs = [store.submit(uid=1, gid=1, user="u", spec=_spec(f"/bin/p{i}"), now=0.0) for i in range(count)]
    for i, job in enumerate(jobs):
        store.transition(job, JobState.CANCELLED, now=first_end + i, reason="cancelled", ended_at=first_end + i)
    return [job.id for job in jobs]


def test_pruning_walks_the_ended_index_and_sorts_nothing(tmp_path: Path) -> None:
    """Given `state IN (...)`, SQLite chose the state index and sorted every finished job in a temporary
    B-tree, twice per batch of 500: 120-220 ms a batch at 79k finished jobs, on the event loop, for 14 s
    after a mass cancel. Every query a prune runs is planned without a sort."""
    store = Store(str(tmp_path / "gpusched.db"))
    _finished(store, 30, first_end=100.0)
    statements: list[str] = []
    store._db.set_trace_callback(statements.append)
    assert len(store.prune_finished(ended_before=0.0, keep=10, batch=8)) == 8
    store._db.set_trace_callback(None)
    ordered = [sql for sql in statements if sql.lstrip().startswith("SELECT") and "ORDER BY" in sql]
    assert len(ordered) == 2  # the cutoff and the candidates
    for sql in ordered:
        plan = " / ".join(row[3] for row in store._db.execute("EXPLAIN QUERY PLAN " + sql))
        assert "jobs_ended" in plan and "TEMP B-TREE" not in plan, plan
    store.close()


def test_a_cutoff_worked_out_before_more_jobs_end_prunes_no_newer_job(tmp_path: Path) -> None:
    """Daemon.prune works the cutoff out once for its run of batches; jobs that end meanwhile must
    not lose the newest `keep` their place."""
    store = Store(str(tmp_path / "gpusched.db"))
    older = _finished(store, 12, first_end=100.0)
    cutoff = store.prune_cutoff(5)
    assert cutoff[1] == older[6]  # the 6th newest: it and the 6 before it may go
    newer = _finished(store, 4, first_end=200.0)  # they end while the run goes on
    deleted: list[int] = []
    while ids := store.prune_finished(ended_before=0.0, keep=5, batch=3, cutoff=cutoff):
        deleted += ids
    assert deleted == older[:7]  # a fresh cutoff would also take older[7:11]; the stale one never more
    assert all(store.get(i) is not None for i in older[7:] + newer)
    # The next run's own cutoff catches up.
    assert store.prune_finished(ended_before=0.0, keep=5, cutoff=store.prune_cutoff(5)) == older[7:11]
    assert store.prune_cutoff(100) == (float("-inf"), 0)
    store.close()


def test_a_schema_1_database_gets_its_listing_columns(tmp_path: Path) -> None:
    path = tmp_path / "gpusched.db"
    db = sqlite3.connect(path)
    db.executescript(_SCHEMA_1)
    for i, spec in enumerate([_spec("/opt/bin/train"), _spec("x", name="named")]):
        db.execute("INSERT INTO jobs (uid, gid, user, spec, state, submitted_at, ended_at) VALUES (1, 1, 'u', ?, "
                   "'CANCELLED', ?, ?)", (spec.model_dump_json(), i, i))
    db.commit()
    db.close()
    store = Store(str(path))
    assert store.get_meta("schema_version") == str(SCHEMA_VERSION)
    rows = store.summaries(limit=10, finished=True)
    assert [(r.display, r.request, r.state) for r in rows] == [
        ("train", "gpus=2", JobState.CANCELLED), ("named", "gpus=2", JobState.CANCELLED)]
    store.close()


def test_summaries_page_and_prune(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "gpusched.db"))
    jobs = [store.submit(uid=1, gid=1, user="u", spec=_spec(f"/bin/p{i}"), now=float(i)) for i in range(6)]
    for job in jobs[:5]:
        store.transition(job, JobState.CANCELLED, now=10.0 + job.id, reason="cancelled", ended_at=10.0 + job.id)
    reader = StoreReader.open(store.path)
    assert [r.id for r in reader.summaries(limit=2, after_id=jobs[1].id)] == [jobs[2].id, jobs[3].id]
    assert [r.display for r in reader.summaries(limit=2, finished=True)] == ["p3", "p4"]
    # Keep the newest 3 finished, except that job 1 is protected (a dependency); the pending job stays.
    assert store.prune_finished(ended_before=0.0, keep=3, protect={jobs[0].id}) == [jobs[1].id]
    assert store.prune_finished(ended_before=0.0, keep=3, protect={jobs[0].id}) == []
    # By age: everything that ended before 14.5 goes (jobs 3 and 4 ended at 13 and 14), the protected one stays.
    assert store.prune_finished(ended_before=14.5, keep=100, protect={jobs[0].id}) == [jobs[2].id, jobs[3].id]
    assert [r.id for r in reader.summaries(limit=10, after_id=0)] == [jobs[0].id, jobs[4].id, jobs[5].id]
    assert store.get(jobs[1].id) is None and reader.owner(jobs[5].id) == (1, "u", JobState.PENDING)
    reader.close()
    store.close()


def test_a_schema_2_database_gets_arrays_and_keeps_its_jobs(tmp_path: Path) -> None:
    path = tmp_path / "gpusched.db"
    db = sqlite3.connect(path)
    db.executescript(_SCHEMA_1.replace("'1'", "'2'"))
    db.execute("ALTER TABLE jobs ADD COLUMN display TEXT")
    db.execute("ALTER TABLE jobs ADD COLUMN request TEXT")
    db.execute("INSERT INTO jobs (uid, gid, user, spec, state, submitted_at, display, request) VALUES "
               "(1, 1, 'u', ?, 'PENDING', 1.0, 'old', 'gpus=2')", (_spec("old").model_dump_json(),))
    db.commit()
    db.close()
    store = Store(str(path))
    assert store.get_meta("schema_version") == str(SCHEMA_VERSION)
    [old] = store.jobs_in([JobState.PENDING])
    assert (old.id, old.array_id, old.array_task) == (1, None, None)
    array_id, tasks = store.submit_array(uid=1, gid=1, user="u", spec=_spec("sweep"), now=2.0,
                                         array=parse_array_spec("0-4:2%1"))
    assert array_id == 2 and [(t.id, t.array_task) for t in tasks] == [(3, 0), (4, 2), (5, 4)]
    store.close()


def test_an_array_is_one_row_plus_its_tasks_sharing_one_spec(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "gpusched.db"))
    first = store.submit(uid=1, gid=1, user="u", spec=_spec("/bin/one"), now=1.0, request_id="k1")
    array_id, tasks = store.submit_array(uid=1, gid=1, user="u", spec=_spec("/bin/sweep"), now=2.0,
                                         array=parse_array_spec("1-3"), hold=True, request_id="k2")
    after = store.submit(uid=1, gid=1, user="u", spec=_spec("/bin/two"), now=3.0)
    assert (first.id, array_id, [t.id for t in tasks], after.id) == (1, 2, [3, 4, 5], 6)  # ids never collide
    assert store.get(array_id) is None and store.arrays([array_id])[array_id].task_count == 3
    assert store._db.execute("SELECT COUNT(*) FROM jobs WHERE spec = ''").fetchone()[0] == 3  # one spec stored
    loaded = store.jobs_in([JobState.HELD])
    assert [j.array_task for j in loaded] == [1, 2, 3] and loaded[0].spec is loaded[2].spec
    assert [t.state for t in loaded[0].history] == [JobState.PENDING, JobState.HELD]
    assert (store.task_job_id(array_id, 2), store.task_job_id(array_id, 9)) == (4, None)
    assert (store.submit_key(1, "k1"), store.submit_key(1, "k2"), store.submit_key(2, "k1")) == (1, 2, None)
    assert store.array_counts([array_id]) == {array_id: {"HELD": 3}}
    assert list(store.arrays()) == [array_id]  # it has unfinished tasks
    for task in loaded:
        store.transition(task, JobState.CANCELLED, now=5.0, reason="cancelled", ended_at=5.0)
    assert list(store.arrays()) == []
    # The array and its submit key go with its last task.
    assert sorted(store.prune_finished(ended_before=10.0, keep=0, protect={3})) == [4, 5]
    assert store.arrays([array_id]) and store.submit_key(1, "k2") == array_id
    assert store.prune_finished(ended_before=10.0, keep=0) == [3]
    assert not store.arrays([array_id]) and store.submit_key(1, "k2") is None
    store.close()


def test_a_protected_array_keeps_one_task_per_state_and_the_rest_is_pruned(tmp_path: Path) -> None:
    """`--after ARRAY` reads how the array ended from the states its tasks ended in: protecting the
    array keeps one task of each (the lowest id), not all of them (one held job's 64 `--after` slots
    kept 64 arrays of 10,001 tasks)."""
    store = Store(str(tmp_path / "gpusched.db"))
    array_id, tasks = store.submit_array(uid=1, gid=1, user="u", spec=_spec("/bin/sweep"), now=1.0,
                                         array=parse_array_spec("1-5"))
    plain = store.submit(uid=1, gid=1, user="u", spec=_spec("/bin/one"), now=2.0)
    for job in [*tasks[:3], plain]:
        store.transition(job, JobState.CANCELLED, now=3.0, reason="cancelled", ended_at=3.0)
    for job in tasks[3:]:
        store.transition(job, JobState.FAILED, now=3.0, reason="unsatisfiable", ended_at=3.0)
    deleted = store.prune_finished(ended_before=10.0, keep=0, protect={array_id}, batch=10)
    assert sorted(deleted) == sorted([tasks[1].id, tasks[2].id, tasks[4].id, plain.id])
    assert store.array_counts([array_id]) == {array_id: {"CANCELLED": 1, "FAILED": 1}}
    assert store.prune_finished(ended_before=10.0, keep=0, protect={array_id}, batch=10) == []
    assert sorted(store.prune_finished(ended_before=10.0, keep=0, batch=10)) == [tasks[0].id, tasks[3].id]
    store.close()


def test_a_schema_3_database_gets_each_jobs_spec_bytes(tmp_path: Path) -> None:
    path = str(tmp_path / "gpusched.db")
    store = Store(path)
    plain = store.submit(uid=1, gid=1, user="u", spec=_spec("/bin/one"), now=1.0)
    sweep = _spec("/bin/a-much-longer-program-name-for-the-sweep")
    array_id, tasks = store.submit_array(uid=1, gid=1, user="u", spec=sweep, now=2.0, array=parse_array_spec("1-3"))
    store._db.execute("ALTER TABLE jobs DROP COLUMN spec_bytes")  # as schema 3 wrote it
    store.set_meta("schema_version", "3")
    store.close()
    store = Store(path)
    assert store.get_meta("schema_version") == str(SCHEMA_VERSION)
    stored = dict(store._db.execute("SELECT id, spec_bytes FROM jobs").fetchall())
    share = -(-spec_bytes(sweep) // 3)
    assert stored == {plain.id: spec_bytes(_spec("/bin/one")), **{t.id: share for t in tasks}}
    assert store.waiting_totals() == {1: (4, spec_bytes(_spec("/bin/one")) + 3 * share)}
    assert array_id in store.arrays([array_id])
    store.close()


def test_a_change_whose_commit_fails_leaves_no_transaction_open(tmp_path: Path) -> None:
    """A COMMIT can fail (here a foreign key checked only at COMMIT): the change is rolled back and
    raised, and the next change starts its own transaction instead of failing on a stale one."""
    store = Store(str(tmp_path / "db.sqlite"))
    with pytest.raises(sqlite3.IntegrityError), store._tx() as db:
        db.execute("PRAGMA defer_foreign_keys = ON")  # for this transaction only
        db.execute("INSERT INTO transitions (job_id, seq, state, at, reason) VALUES (999, 0, 'PENDING', 0, 'x')")
    assert not store._db.in_transaction
    store.set_meta("after", "works")
    assert store.get_meta("after") == "works"
    assert store._db.execute("SELECT COUNT(*) FROM transitions").fetchone()[0] == 0


def test_jobs_in_several_states_come_back_in_submission_order_with_their_histories(tmp_path: Path) -> None:
    """A restart loads each state off its index and merges them: the order is still the ids'."""
    store = Store(str(tmp_path / "state.db"))
    states = [JobState.PENDING, JobState.HELD, JobState.STARTING, JobState.PENDING, JobState.HELD,
              JobState.COMPLETED, JobState.STARTING, JobState.PENDING]
    ids = []
    for i, state in enumerate(states):
        job = store.submit(uid=1000, gid=1000, user="alice", spec=_spec(f"p{i}"), now=float(i),
                           hold=state is JobState.HELD)
        if state in (JobState.STARTING, JobState.COMPLETED):
            job = store.transition(job, JobState.STARTING, now=i + 0.5, reason="placed")
        if state is JobState.COMPLETED:
            job = store.transition(job, JobState.RUNNING, now=i + 0.6, reason="started")
            job = store.transition(job, JobState.COMPLETED, now=i + 0.7, reason="exit 0")
        ids.append(job.id)
    store.close()
    loaded = Store(str(tmp_path / "state.db")).jobs_in([JobState.STARTING, JobState.HELD, JobState.PENDING])
    assert [j.id for j in loaded] == [i for i, s in zip(ids, states, strict=True) if s is not JobState.COMPLETED]
    assert [j.spec.argv[0] for j in loaded] == [f"p{i}" for i, s in enumerate(states) if s is not JobState.COMPLETED]
    assert all(j.history[-1].state is j.state for j in loaded)


def test_unsynced_changes_commit_without_an_fsync_and_leave_the_next_ones_durable(tmp_path: Path) -> None:
    """`unsynced` turns SQLite's commit fsync off for its own commits only: what it wrote is committed
    (another connection reads it), every later commit is FULL again (also after a failure), and inside
    an open transaction it changes nothing. It is NORMAL, never OFF: a checkpoint that falls in such a
    commit must still sync the WAL and the database file (OFF skips both, and the WAL is then written
    over: a power loss could lose what was acknowledged before)."""
    store = Store(str(tmp_path / "state.db"))
    level = lambda: store._db.execute("PRAGMA synchronous").fetchone()[0]  # noqa: E731 - 0 OFF, 1 NORMAL, 2 FULL
    assert level() == 2
    with store.unsynced():
        assert level() == 1
        store.set_meta("standing", "1")
    assert level() == 2
    other = sqlite3.connect(str(tmp_path / "state.db"))
    assert other.execute("SELECT value FROM meta WHERE key = 'standing'").fetchone() == ("1",)
    with pytest.raises(RuntimeError), store.unsynced():
        raise RuntimeError("a failed save")
    assert level() == 2
    with store.batch(), store.unsynced():
        assert level() == 2  # (the batch's COMMIT is an ordinary one)
        store.set_meta("standing", "2")
    assert other.execute("SELECT value FROM meta WHERE key = 'standing'").fetchone() == ("2",)
    other.close()
    store.close()


def test_meta_values_ride_on_the_next_commit_and_only_when_they_changed(tmp_path: Path) -> None:
    """`meta_with_next_commit` writes nothing itself: the next COMMIT of anything carries the values
    (a rolled-back change does not, and they wait on), a value equal to the last committed one is not
    written again, and a direct `set_meta` of the same key wins over a waiting one."""
    store = Store(str(tmp_path / "state.db"))
    other = sqlite3.connect(str(tmp_path / "state.db"))
    seen = lambda key: other.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()  # noqa: E731
    spec = JobSpec(argv=["true"], cwd="/", request=WholeRequest(gpus=1))
    store.meta_with_next_commit({"standing": "1", "held_head": "null"})
    assert store.meta_waiting and seen("standing") is None
    with pytest.raises(RuntimeError), store._tx():
        store._db.execute("DELETE FROM events")
        raise RuntimeError("a change that is rolled back")
    assert store.meta_waiting and seen("standing") is None
    store.submit(uid=1000, gid=1000, user="alice", spec=spec, now=1.0)  # an unrelated change commits
    assert not store.meta_waiting and seen("standing") == ("1",) and seen("held_head") == ("null",)
    store.meta_with_next_commit({"standing": "1", "held_head": "7"})  # standing unchanged
    changes = store._db.total_changes
    store.commit_meta()
    assert store._db.total_changes == changes + 1 and seen("held_head") == ("7",)
    store.meta_with_next_commit({"standing": "1", "held_head": "7"})
    assert not store.meta_waiting  # nothing changed: no COMMIT at all
    store.meta_with_next_commit({"standing": "2"})
    store.set_meta("standing", "3")
    store.submit(uid=1000, gid=1000, user="alice", spec=spec, now=2.0)
    assert seen("standing") == ("3",)
    store.meta_with_next_commit({"standing": "3"})  # not known as committed by a rider: written
    assert store.meta_waiting
    other.close()
    store.close()


def test_a_jobs_first_transition_is_implied_and_histories_read_back_whole(tmp_path: Path) -> None:
    """Schema 6: a plain submit stores no transitions row (its PENDING at submitted_at, 'submitted'
    is implied); a hold stores its HELD as seq 1; an array's tasks store none; every history reads
    back exactly as the submit returned it, and so do seq 0 rows a schema 5 daemon wrote."""
    path = str(tmp_path / "state.db")
    store = Store(path)
    plain = store.submit(uid=1, gid=1, user="u", spec=_spec("/bin/a"), now=10.0)
    held = store.submit(uid=1, gid=1, user="u", spec=_spec("/bin/b"), now=11.0, hold=True)
    requeued = store.submit(uid=1, gid=1, user="u", spec=_spec("/bin/c"), now=12.0, reason="requeued by test")
    _, tasks = store.submit_array(uid=1, gid=1, user="u", spec=_spec("/bin/d"), now=13.0,
                                  array=parse_array_spec("1-2"))
    started = store.transition(plain, JobState.STARTING, now=14.0, reason="placed")
    rows = store._db.execute("SELECT job_id, seq, state, reason FROM transitions ORDER BY job_id, seq").fetchall()
    assert rows == [(plain.id, 1, "STARTING", "placed"), (held.id, 1, "HELD", "held at submission"),
                    (requeued.id, 0, "PENDING", "requeued by test")]
    # as schema 5 wrote it: a seq 0 row for every job
    old = store.submit(uid=1, gid=1, user="u", spec=_spec("/bin/e"), now=15.0)
    store._db.execute("INSERT INTO transitions (job_id, seq, state, at, reason) VALUES (?, 0, 'PENDING', 15.0, "
                      "'submitted')", (old.id,))
    store.close()
    store = Store(path)
    for job in (started, held, requeued, *tasks, old):
        loaded = store.get(job.id)
        assert loaded is not None and loaded.history == job.history, job.id
    assert [t.reason for t in started.history] == ["submitted", "placed"]
    loaded_all = {j.id: j.history for j in store.jobs_in(set(JobState))}
    assert loaded_all == {j.id: j.history for j in (started, held, requeued, *tasks, old)}
    store.close()


def test_a_current_database_is_not_scanned_for_fill_ins_at_open(tmp_path: Path) -> None:
    """The listing columns and spec sizes are filled in once, by the upgrade from an older schema;
    opening a database already at SCHEMA_VERSION reads no row for them (a full scan each, at every
    start). Seen from outside: a NULL left in a current database stays NULL, and one in a database
    marked one version older is filled in."""
    path = str(tmp_path / "state.db")
    store = Store(path)
    job = store.submit(uid=1, gid=1, user="u", spec=_spec("/bin/a"), now=1.0)
    store._db.execute("UPDATE jobs SET display = NULL, spec_bytes = NULL WHERE id = ?", (job.id,))
    store.close()
    row = "SELECT display, spec_bytes FROM jobs WHERE id = ?"
    store = Store(path)
    assert store._db.execute(row, (job.id,)).fetchone() == (None, None)
    store.set_meta("schema_version", str(SCHEMA_VERSION - 1))
    store.close()
    store = Store(path)
    assert store._db.execute(row, (job.id,)).fetchone() == ("a", spec_bytes(_spec("/bin/a")))
    store.close()
