"""Group commit against real SQLite: many writes, one COMMIT; nobody hears back before it is durable;
one bad write fails alone; a batch that cannot commit acknowledges nothing."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from gpusched.daemon.groupcommit import GroupCommit, Write
from gpusched.daemon.store import Store, StoreReader
from gpusched.model import Job, JobSpec, WholeRequest

SPEC = JobSpec(argv=["true"], cwd="/tmp", request=WholeRequest(gpus=1))


def _submit(store: Store, name: str) -> Job:
    return store.submit(uid=1, gid=1, user="u", spec=SPEC.model_copy(update={"name": name}), now=1.0)


def test_concurrent_writes_share_one_commit_and_are_durable_before_anyone_hears(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "db.sqlite"))
    outside = StoreReader.open(store.path)  # another connection: it sees only what is committed
    seen_when_committed: list[bool] = []

    async def main() -> list[Job]:
        group = GroupCommit(store)

        async def one(i: int) -> Job:
            def committed(job: Job) -> None:
                seen_when_committed.append(outside.get(job.id) is not None)

            return await group.write(Write(apply=lambda: _submit(store, f"j{i}"), committed=committed,
                                           failed=lambda exc: None))

        jobs = await asyncio.gather(*(one(i) for i in range(16)))
        assert (group.commits, group.writes) == (1, 16)
        return jobs

    jobs = asyncio.run(main())
    assert seen_when_committed == [True] * 16
    assert sorted(j.spec.name or "" for j in jobs) == sorted(f"j{i}" for i in range(16))
    assert [outside.get(j.id) is not None for j in jobs] == [True] * 16


def test_a_failing_write_fails_alone(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "db.sqlite"))
    failed: list[str] = []

    def broken() -> Job:
        _submit(store, "half-written")  # written inside its savepoint, then the write fails
        raise ValueError("boom")

    async def main() -> list[Job | BaseException]:
        group = GroupCommit(store)
        writes = [Write(apply=lambda i=i: _submit(store, f"ok{i}"), committed=lambda job: None,
                        failed=lambda exc: failed.append(str(exc))) for i in range(3)]
        writes.insert(1, Write(apply=broken, committed=lambda job: None, failed=lambda exc: failed.append(str(exc))))
        return await asyncio.gather(*(group.write(w) for w in writes), return_exceptions=True)

    results = asyncio.run(main())
    assert isinstance(results[1], ValueError) and failed == ["boom"]
    assert sorted(r.display for r in store.summaries(limit=10)) == ["ok0", "ok1", "ok2"]  # no "half-written"
    # The batch was written twice (all at once, then write by write): what each caller heard is what is stored.
    for result in (results[0], *results[2:]):
        assert isinstance(result, Job)
        stored = store.get(result.id)
        assert stored is not None and stored.spec.name == result.spec.name


def test_a_batch_whose_writes_all_succeed_takes_no_savepoints(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "db.sqlite"))
    statements: list[str] = []
    store._db.set_trace_callback(statements.append)

    async def main() -> None:
        group = GroupCommit(store)
        await asyncio.gather(*(group.write(Write(apply=lambda i=i: _submit(store, f"j{i}"), committed=lambda job: None,
                                                 failed=lambda exc: None)) for i in range(8)))
        assert (group.commits, group.writes) == (1, 8)

    asyncio.run(main())
    store._db.set_trace_callback(None)
    assert not [s for s in statements if "SAVEPOINT" in s.upper()]
    assert [s for s in statements if s.split()[0].upper() in ("BEGIN", "COMMIT", "ROLLBACK")] == [
        "BEGIN IMMEDIATE", "COMMIT"]
    assert len(store.summaries(limit=10)) == 8


def test_a_batch_that_cannot_commit_acknowledges_nothing(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "db.sqlite"))
    store._db.execute("PRAGMA busy_timeout = 0")
    blocker = sqlite3.connect(store.path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # another writer holds the database: our batch cannot begin
    failed: list[BaseException] = []
    committed: list[Job] = []

    async def main() -> list[Job | BaseException]:
        group = GroupCommit(store)
        writes = [Write(apply=lambda i=i: _submit(store, f"j{i}"), committed=committed.append,
                        failed=failed.append) for i in range(4)]
        return await asyncio.gather(*(group.write(w) for w in writes), return_exceptions=True)

    results = asyncio.run(main())
    blocker.execute("ROLLBACK")
    assert all(isinstance(r, sqlite3.OperationalError) for r in results)
    assert len(failed) == 4 and committed == []
    assert store.summaries(limit=10) == []


def test_a_write_whose_caller_left_is_never_written(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "db.sqlite"))
    failed: list[BaseException] = []

    async def main() -> None:
        group = GroupCommit(store)
        gone = Write(apply=lambda: _submit(store, "gone"), committed=lambda job: None, failed=failed.append)
        kept = Write(apply=lambda: _submit(store, "kept"), committed=lambda job: None, failed=failed.append)
        group.write(gone).cancel()
        await group.write(kept)

    asyncio.run(main())
    assert [r.display for r in store.summaries(limit=10)] == ["kept"]
    assert len(failed) == 1 and isinstance(failed[0], asyncio.CancelledError)


@pytest.mark.parametrize("size", [1, 1500])
def test_batches_are_bounded(tmp_path: Path, size: int) -> None:
    store = Store(str(tmp_path / "db.sqlite"))

    async def main() -> GroupCommit:
        group = GroupCommit(store, max_batch=1000)
        await asyncio.gather(*(group.write(Write(apply=lambda i=i: _submit(store, f"j{i}"),
                                                 committed=lambda job: None, failed=lambda exc: None))
                               for i in range(size)))
        return group

    group = asyncio.run(main())
    assert group.writes == size and group.commits == (1 if size <= 1000 else 2)
