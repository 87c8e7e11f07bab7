"""The in-memory form of jobs (daemon/compact.py): equal to what validation builds, parts shared."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpusched.daemon import compact
from gpusched.daemon.compact import Compactor, _Pool, _Table
from gpusched.daemon.store import Store
from gpusched.model import (
    Dependency,
    Job,
    JobSpec,
    JobState,
    MigRequest,
    PartitionRequest,
    ShareRequest,
    WholeRequest,
    spec_bytes,
)

_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1, max_size=12)
_requests = st.one_of(
    st.builds(WholeRequest, gpus=st.integers(1, 8)),
    st.builds(MigRequest, profile=st.sampled_from(["1g.10gb", "3g.40gb", "1g.20gb+me"])),
    st.builds(ShareRequest, fraction=st.floats(0.01, 1.0), gpu_mem_mib=st.integers(1, 80_000)),
    st.builds(PartitionRequest, mode=st.sampled_from(["SPX", "DPX", "QPX", "CPX"]), gpus=st.integers(1, 8)),
)
_specs = st.builds(
    JobSpec,
    argv=st.lists(_text, min_size=1, max_size=4),
    cwd=_text.map(lambda t: "/" + t),
    env=st.dictionaries(_text, _text, max_size=4),
    request=_requests,
    name=st.none() | _text,
    time_limit_s=st.none() | st.floats(0.5, 1e6),
    job_class=st.sampled_from(["batch", "interactive"]),
    nice=st.integers(0, 19),
    requeue=st.booleans(),
    precision=st.none() | st.sampled_from(["fp16", "bf16", "fp32", "tf32"]),
    after=st.lists(st.builds(Dependency, job_id=st.integers(1, 10**6), condition=st.sampled_from(["ok", "any"])),
                   max_size=2),
    cpus=st.none() | st.integers(1, 64),
    mem_mib=st.none() | st.integers(1, 10**6),
)


def _validated(job: Job) -> Job:
    return Job.model_validate(job.model_dump())


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=_specs)
def test_a_loaded_job_is_the_job_validation_would_build(tmp_path_factory, spec: JobSpec) -> None:  # type: ignore[no-untyped-def]
    store = Store(os.path.join(tmp_path_factory.mktemp("db"), "state.db"))
    try:
        submitted = store.submit(uid=1000, gid=1000, user="alice", spec=spec, now=5.0)
        loaded = store.get(submitted.id)
        assert loaded is not None
        for job in (submitted, loaded):
            assert job == _validated(job)
            assert job.model_dump_json() == _validated(job).model_dump_json()
            assert job.spec == spec
        moved = store.transition(loaded, JobState.STARTING, now=6.0, reason="placed", pid=None)
        assert moved.state is JobState.STARTING and loaded.state is JobState.PENDING
        assert moved == _validated(moved)
    finally:
        store.close()


@pytest.fixture
def store(tmp_path):  # type: ignore[no-untyped-def]
    """A store in tmp_path (its database `state.db`, which a test may open again), closed afterwards."""
    opened = Store(str(tmp_path / "state.db"))
    yield opened
    opened.close()


def test_jobs_with_the_same_spec_share_it_and_different_specs_share_their_parts(store, tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = {"PATH": "/usr/bin", "HOME": "/home/alice"}
    same = JobSpec(argv=["train.py"], cwd="/work", env=dict(env), request=WholeRequest(gpus=1))
    other = JobSpec(argv=["train.py", "--lr", "3"], cwd="/work", env=dict(env), request=WholeRequest(gpus=1))
    a, b, c = (store.submit(uid=1000, gid=1000, user="alice", spec=s, now=1.0) for s in (same, same, other))
    assert a.spec is b.spec
    assert a.spec is not c.spec and a.spec.env is c.spec.env and a.spec.request is c.spec.request
    assert a.spec.cwd is c.spec.cwd
    # A restart loads them with the same sharing.
    loaded = Store(str(tmp_path / "state.db")).jobs_in([JobState.PENDING])
    assert loaded[0].spec is loaded[1].spec and loaded[0].spec.env is loaded[2].spec.env


def test_a_copy_never_changes_what_other_jobs_share(store) -> None:  # type: ignore[no-untyped-def]
    """Constructed jobs share one fields-set object; pydantic must copy it before changing it."""
    job = store.submit(uid=1000, gid=1000, user="alice", spec=JobSpec(argv=["x"], cwd="/", request=WholeRequest(
        gpus=1)), now=1.0)
    before = set(compact._JOB_SET)
    job.model_copy(update={"pid": 7})
    assert before == compact._JOB_SET
    assert job.pid is None


def test_a_spec_stored_by_an_older_version_goes_through_validation(store, tmp_path) -> None:  # type: ignore[no-untyped-def]
    job = store.submit(uid=1000, gid=1000, user="alice", spec=JobSpec(argv=["x"], cwd="/", request=WholeRequest(
        gpus=2)), now=1.0)
    old = json.loads(job.spec.model_dump_json())
    del old["precision"], old["cpus"]  # fields this version added
    store._db.execute("UPDATE jobs SET spec = ? WHERE id = ?", (json.dumps(old), job.id))
    fresh = Store(str(tmp_path / "state.db"))
    loaded = fresh.get(job.id)
    assert loaded is not None and loaded.spec.precision is None and loaded.spec.cpus is None
    assert loaded == _validated(loaded)
    fresh.close()


def test_the_sharing_tables_are_bounded() -> None:
    table: _Table[str, str] = _Table(2)
    for key in ("a", "b", "c"):
        table.share(key, key)
    assert list(table) == ["b", "c"]
    assert table.share("b", "other") == "b" and list(table) == ["c", "b"]  # a hit is the most recent


def test_the_shared_spec_table_is_bounded_by_its_capacity() -> None:
    compactor = Compactor(capacity=3)
    for i in range(10):
        spec = JobSpec(argv=["x", str(i)], cwd="/", request=WholeRequest(gpus=1))
        compactor.spec(spec, spec.model_dump_json())
    assert len(compactor._specs) == 3 and 1 <= len(compactor._argvs) <= 3


def test_a_pool_starts_over_when_full_and_shares_until_then() -> None:
    pool: _Pool[str, str] = _Pool(2)
    first = "".join(["com", "mon"])  # a string object of its own, not an interned literal
    assert pool.share("common", first) is first
    assert pool.share("common", "".join(["com", "mon"])) is first  # the same object comes back
    pool.share("other", "other")
    pool.share("third", "third")  # full: starts over
    assert list(pool) == ["third"]


def test_spec_bytes_are_counted_once_per_shared_spec_and_right_for_each() -> None:
    compactor = Compactor(capacity=2)
    specs = [JobSpec(argv=["x" * n], cwd="/", request=WholeRequest(gpus=1)) for n in (1, 10, 100)]
    for spec in specs * 2:  # the third evicts the first: sizes stay right after eviction
        assert compactor.spec_bytes(spec) == spec_bytes(spec)
    assert len(compactor._sizes) == 2


_tricky_argv = st.lists(st.one_of(_text, st.sampled_from(['],"cwd":"/x"', '\\', '"', '\\"],"cwd":', '{"argv":[', ']'])),
                        min_size=1, max_size=4)


@settings(max_examples=200)
@given(spec=_specs, argv=_tricky_argv, env_apart=st.booleans())
def test_a_spec_parsed_apart_from_its_argv_is_the_spec_validation_builds(spec: JobSpec, argv: list[str],
                                                                          env_apart: bool) -> None:
    """A restart parses a sweep's specs by argv alone, the rest once (Compactor._from_parts): whatever
    argv holds (quotes, backslashes, the very text that marks its end), the spec is exactly the one
    pydantic validates from the stored text, after one with the same rest and another argv too."""
    compactor = Compactor()
    other = spec.model_copy(update={"argv": argv})
    for each in (spec, other):
        if env_apart:
            stored = each.model_dump_json(exclude={"env"})
            loaded = compactor.spec_from_json(stored, (each.env, b"digest"))
        else:
            stored = each.model_dump_json()
            loaded = compactor.spec_from_json(stored)
        assert loaded == each and loaded.model_dump_json() == each.model_dump_json()
        assert JobSpec.model_validate(loaded.model_dump()) == loaded
    first, second = (compactor.spec_from_json(s.model_dump_json()) for s in (spec, other))
    assert first.request is second.request and first.env is second.env  # the rest is shared
    # ... and it was parsed apart: a spec of today's shape never needs the whole-text path
    assert Compactor()._from_parts(other.model_dump_json(), None) == other


def test_a_stored_spec_of_another_shape_is_not_split_at_argv() -> None:
    """Texts a version with another field order might have written: parsed whole, never misread."""
    compactor = Compactor()
    spec = JobSpec(argv=["a", "b"], cwd="/w", request=WholeRequest(gpus=1), after=[Dependency(job_id=3)])
    fields = json.loads(spec.model_dump_json())
    reordered = {"argv": fields["argv"], "after": fields["after"], **{k: v for k, v in fields.items()
                                                                      if k not in ("argv", "after")}}
    for text in (json.dumps(reordered, separators=(",", ":")), json.dumps(fields)):  # (and with spaces)
        assert compactor._from_parts(text, None) is None
        assert compactor.spec_from_json(text) == spec
    assert compactor._from_parts(spec.model_dump_json(), None) == spec


def test_histories_keep_each_jobs_order_and_equal_validated_transitions() -> None:
    """`add_histories` (a restart's 100k rows): each job's transitions in row order, appended to what
    `out` already holds for it, each equal to a validated Transition (state, time, reason), and one
    reason string shared by every row that repeats it."""
    from gpusched.model import Transition

    states = {s.value: s for s in JobState}
    out: dict[int, list[Transition]] = {3: [Transition(state=JobState.PENDING, at=0.5, reason="submitted")]}
    first, second = "".join(["sub", "mitted"]), "".join(["sub", "mitted"])  # equal, two objects
    assert first is not second
    rows = [(1, 0, "PENDING", 1.0, first), (1, 1, "STARTING", 2.0, "placed"), (2, 0, "PENDING", 3.0, second),
            (3, 1, "HELD", 4.0, "held by user"), (4, 1, "HELD", 5.0, "held at submission")]
    Compactor().add_histories(iter(rows), states, out, {1: 9.0, 2: 9.0, 3: 9.0, 4: 5.0})
    assert sorted(out) == [1, 2, 3, 4]
    assert out[1] == [Transition(state=JobState.PENDING, at=1.0, reason="submitted"),
                      Transition(state=JobState.STARTING, at=2.0, reason="placed")]
    assert [t.state for t in out[3]] == [JobState.PENDING, JobState.HELD]
    # rows from seq 1: the first transition, which no row stores, is the submit's (schema.FIRST_REASON)
    assert out[4] == [Transition(state=JobState.PENDING, at=5.0, reason="submitted"),
                      Transition(state=JobState.HELD, at=5.0, reason="held at submission")]
    assert out[1][0].reason is out[2][0].reason
    assert out[2][0].model_dump() == Transition.model_validate(out[2][0].model_dump()).model_dump()
