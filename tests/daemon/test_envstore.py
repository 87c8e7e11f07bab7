"""Large environments are stored once each (envstore.py, schema 5), on real SQLite files: what a row
holds, what a restart reads back, pruning, rollbacks, and databases written before schema 5."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from gpusched.arrayspec import parse_array_spec
from gpusched.daemon.envstore import INLINE_MAX, MissingEnvironment, env_json
from gpusched.daemon.schema import SCHEMA_VERSION
from gpusched.daemon.store import Store
from gpusched.model import JobSpec, JobState, WholeRequest, spec_bytes

# What a module system leaves in a shell: ~6 KB, far over INLINE_MAX.
BIG = {f"VAR_{k}": f"/opt/software/pkg{k}/1.2.3/lib:/opt/software/other{k}/lib64:/usr/local/cuda/lib64"
       for k in range(60)}
SMALL = {"PATH": "/usr/bin:/bin", "HOME": "/home/u"}


def _spec(program: str, env: dict[str, str]) -> JobSpec:
    return JobSpec(argv=[program, "--x"], cwd="/tmp", env=env, request=WholeRequest(gpus=1))


def _rows(store: Store) -> list[tuple[int, str, int | None]]:
    return store._db.execute("SELECT id, spec, env_id FROM jobs ORDER BY id").fetchall()


def test_a_large_environment_is_stored_once_and_read_back_whole(tmp_path: Path) -> None:
    big = env_json(BIG)
    assert big is not None and len(big) > INLINE_MAX and env_json(SMALL) is None
    path = str(tmp_path / "gpusched.db")
    store = Store(path)
    jobs = [store.submit(uid=1, gid=1, user="u", spec=_spec(f"/bin/p{i}", BIG), now=float(i)) for i in range(3)]
    small = store.submit(uid=1, gid=1, user="u", spec=_spec("/bin/s", SMALL), now=5.0)
    rows = _rows(store)
    assert store._db.execute("SELECT COUNT(*) FROM envs").fetchone()[0] == 1
    assert [env_id is not None for _, _, env_id in rows] == [True, True, True, False]
    assert all('"env"' not in text for _, text, env_id in rows if env_id is not None)
    assert '"PATH":"/usr/bin:/bin"' in rows[3][1]  # a small one stays inside the spec
    assert all(len(text) < 300 for _, text, env_id in rows if env_id is not None)  # against ~6 KB each before
    store.close()

    again = Store(path)  # what a restart reads
    loaded = again.jobs_in([JobState.PENDING])
    assert [j.spec for j in loaded] == [j.spec for j in [*jobs, small]]
    assert [j.spec.env for j in loaded] == [BIG, BIG, BIG, SMALL]
    assert loaded[0].spec.env is loaded[2].spec.env  # parsed once, shared by every job naming it
    assert again.waiting_totals() == {1: (4, sum(spec_bytes(j.spec) for j in jobs) + spec_bytes(small.spec))}
    assert again.get(jobs[1].id) == loaded[1]
    again.close()


def test_the_same_command_with_another_environment_is_another_spec(tmp_path: Path) -> None:
    """Two rows with the same spec text (their environments apart) are not one spec in memory, at
    submission or when read back: the environment's digest is part of what is shared."""
    path = str(tmp_path / "gpusched.db")
    store = Store(path)
    other = {**BIG, "CUDA_VISIBLE_DEVICES_WANTED": "elsewhere"}
    first, second = (store.submit(uid=1, gid=1, user="u", spec=_spec("/same", env), now=1.0) for env in (BIG, other))
    texts = [text for _, text, _ in _rows(store)]
    assert texts[0] == texts[1]
    assert (first.spec.env, second.spec.env) == (BIG, other)
    store.close()
    loaded = Store(path).jobs_in([JobState.PENDING])
    assert [j.spec.env for j in loaded] == [BIG, other]


def test_an_environment_goes_with_the_last_job_that_names_it(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "gpusched.db"))
    other = {**BIG, "EXTRA": "x"}
    first, second = (store.submit(uid=1, gid=1, user="u", spec=_spec(p, BIG), now=1.0) for p in ("/a", "/b"))
    third = store.submit(uid=2, gid=2, user="v", spec=_spec("/c", other), now=1.0)
    assert store._db.execute("SELECT COUNT(*) FROM envs").fetchone()[0] == 2
    for job in (first, third):
        store.transition(job, JobState.CANCELLED, now=2.0, reason="cancelled", ended_at=2.0)
    assert sorted(store.prune_finished(ended_before=10.0, keep=0)) == [first.id, third.id]
    left = store._db.execute("SELECT env FROM envs").fetchall()
    assert len(left) == 1 and (env_json(BIG) or b"").decode() == left[0][0]  # BIG: `second` still names it
    store.transition(second, JobState.CANCELLED, now=3.0, reason="cancelled", ended_at=3.0)
    assert store.prune_finished(ended_before=10.0, keep=0) == [second.id]
    assert store._db.execute("SELECT COUNT(*) FROM envs").fetchone()[0] == 0
    again = store.submit(uid=1, gid=1, user="u", spec=_spec("/d", BIG), now=4.0)  # stored afresh, a new id
    assert store.get(again.id) == again and store._db.execute("SELECT MIN(id) FROM envs").fetchone()[0] == 3
    store.close()


def test_a_rolled_back_submit_leaves_no_environment_and_none_is_remembered(tmp_path: Path) -> None:
    """An id inserted in an undone change is handed out again; what was read under it must not be
    taken for the environment the id names next."""
    store = Store(str(tmp_path / "gpusched.db"))
    other = {**BIG, "EXTRA": "x"}
    with pytest.raises(RuntimeError), store.batch_or_nothing():
        undone = store.submit(uid=1, gid=1, user="u", spec=_spec("/a", BIG), now=1.0)
        assert store.get(undone.id) is not None and store.get(undone.id).spec.env == BIG  # type: ignore[union-attr]
        raise RuntimeError("a write of the batch failed")
    assert store._db.execute("SELECT COUNT(*) FROM envs").fetchone()[0] == 0
    kept = store.submit(uid=1, gid=1, user="u", spec=_spec("/b", other), now=2.0)
    assert _rows(store)[-1][2] == 1  # the id the undone change had used
    loaded = store.get(kept.id)
    assert loaded is not None and loaded.spec.env == other
    store.close()


def test_arrays_keep_their_one_environment_inline(tmp_path: Path) -> None:
    path = str(tmp_path / "gpusched.db")
    store = Store(path)
    store.submit_array(uid=1, gid=1, user="u", spec=_spec("/sweep", BIG), now=1.0, array=parse_array_spec("1-3"))
    assert store._db.execute("SELECT COUNT(*) FROM envs").fetchone()[0] == 0
    store.close()
    loaded = Store(path).jobs_in([JobState.PENDING])
    assert [t.array_task for t in loaded] == [1, 2, 3] and all(t.spec.env == BIG for t in loaded)


def test_a_schema_4_database_keeps_its_inline_environments(tmp_path: Path) -> None:
    path = str(tmp_path / "gpusched.db")
    store = Store(path)
    store.submit(uid=1, gid=1, user="u", spec=_spec("/old", BIG), now=1.0)
    # As schema 4 wrote it: the environment inside the spec, no env_id column, no envs table.
    store._db.execute("UPDATE jobs SET spec = ?", (_spec("/old", BIG).model_dump_json(),))
    store._db.execute("DROP INDEX jobs_env")
    store._db.execute("ALTER TABLE jobs DROP COLUMN env_id")
    store._db.execute("DROP TABLE envs")
    store.set_meta("schema_version", "4")
    store.close()
    store = Store(path)
    assert store.get_meta("schema_version") == str(SCHEMA_VERSION) == "6"
    [old] = store.jobs_in([JobState.PENDING])
    assert old.spec == _spec("/old", BIG)
    new = store.submit(uid=1, gid=1, user="u", spec=_spec("/new", BIG), now=2.0)
    assert [env_id for _, _, env_id in _rows(store)] == [None, 1]
    assert store.get(new.id) == new
    store.close()


def test_a_row_of_an_older_shape_is_validated_with_its_named_environment(tmp_path: Path) -> None:
    """A spec text the fast path does not take (a field missing, as an older version wrote it) goes
    through the model, with the environment its row names: not the model's default, an empty one."""
    path = str(tmp_path / "gpusched.db")
    store = Store(path)
    job = store.submit(uid=1, gid=1, user="u", spec=_spec("/a", BIG), now=1.0)
    store._db.execute("UPDATE jobs SET spec = ?", (job.spec.model_dump_json(exclude={"env", "requeue"}),))
    store.close()
    store = Store(path)
    loaded = store.get(job.id)
    assert loaded is not None and loaded.spec == job.spec and loaded.spec.env == BIG
    store.close()


def test_a_row_naming_an_environment_the_database_lacks_is_reported(tmp_path: Path) -> None:
    path = str(tmp_path / "gpusched.db")
    store = Store(path)
    job = store.submit(uid=1, gid=1, user="u", spec=_spec("/a", BIG), now=1.0)
    store.close()
    db = sqlite3.connect(path)
    db.execute("DELETE FROM envs")
    db.commit()
    db.close()
    store = Store(path)
    with pytest.raises(MissingEnvironment, match="environment 1 is named by a job but not in the database"):
        store.get(job.id)
    store.close()
