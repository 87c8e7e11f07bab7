"""A start's long queue reaches the scheduler after the engine has started, a chunk per turn of the
loop (engine.HAND_OVER_LATER, engine_requests.HAND_OVER_CHUNK), so the socket answers meanwhile:
every job is in memory and listed from the start, no pass decides on part of the queue, and a job
that leaves PENDING before its chunk is not handed over."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

from gpusched.config import DaemonConfig
from gpusched.daemon import engine as engine_module
from gpusched.daemon import engine_requests
from gpusched.daemon import main as daemon_main
from gpusched.daemon.engine import Engine
from gpusched.daemon.executor import Executor
from gpusched.daemon.startup import build_policy, open_gpu_backend
from gpusched.daemon.store import Store
from gpusched.model import JobSpec, JobState, WholeRequest
from gpusched.policy import fairness_order
from tests.conftest import inprocess_config, kill_job_processes, short_tmpdir

QUEUED = 12
T = TypeVar("T")


def _state_with_queue(jobs: int) -> tuple[DaemonConfig, list[int]]:
    """A stopped daemon's state holding `jobs` pending jobs of two users (ids in submission order)."""
    base = short_tmpdir()
    config = inprocess_config(base, allow_root_jobs=True, tick_s=0.05)

    async def create() -> None:
        await daemon_main.stop(await daemon_main.start(config))

    asyncio.run(create())
    store = Store(config.db_path)
    spec = JobSpec(argv=["true"], cwd="/tmp", env={"PATH": os.environ["PATH"]}, request=WholeRequest(gpus=1))
    ids = [store.submit(uid=1000 + i % 2, gid=1000, user=f"u{i % 2}", spec=spec, now=time.time()).id
           for i in range(jobs)]
    store.close()
    return config, ids


def _on_started_engine(config: DaemonConfig, check: Callable[[Engine], Awaitable[T]]) -> T:
    """`check(engine)` right after `Engine.start` over `config`'s state, its loop task cancelled (the
    check drives passes by hand); the engine is stopped and its job processes killed after."""
    async def go() -> T:
        backend, _ = open_gpu_backend(config)
        engine = Engine(config, Store(config.db_path), backend,
                        Executor(config.state_dir, launcher=config.launcher), build_policy(config))
        await engine.start()
        assert engine._loop_task is not None
        engine._loop_task.cancel()
        try:
            return await check(engine)
        finally:
            await engine.stop()
            engine.store.close()

    try:
        return asyncio.run(go())
    finally:
        kill_job_processes(config.state_dir)


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_module, "HAND_OVER_LATER", 4)
    monkeypatch.setattr(engine_requests, "HAND_OVER_CHUNK", 3)


@pytest.mark.usefixtures("small_chunks")
def test_the_queue_arrives_after_start_and_no_pass_runs_before_all_of_it() -> None:
    config, ids = _state_with_queue(QUEUED)
    # one in the first chunk, two in later ones: one held, one held and released at once
    cancelled, held, released = ids[1], ids[7], ids[10]

    async def check(engine: Engine) -> None:
        # start() returned with nothing handed over yet, every job listed all the same
        assert sorted(j.id for j in engine.jobs.values() if j.state is JobState.PENDING) == ids
        assert fairness_order(engine.scheduler) == []
        pending = engine.jobs[ids[0]]
        assert "being handed to the scheduler" in (engine.waiting_reason(pending) or "")
        passes = engine.passes
        await engine._pass()  # asked for before the queue is all in: decides nothing
        assert engine.passes == passes
        assert await engine.cancel(engine.jobs[cancelled], "cancelled by test")
        assert engine.hold(engine.jobs[held], "held by test") is None
        assert engine.hold(engine.jobs[released], "held by test") is None
        assert engine.release(engine.jobs[released], "released by test") is None  # handed over now, once
        engine._wake.clear()
        assert engine._arriving is not None
        await engine._arriving
        assert engine._wake.is_set()  # the last chunk asks for the pass that waited
        order = fairness_order(engine.scheduler)
        assert order is not None and sorted(order) == [i for i in ids if i not in (cancelled, held)]
        assert order.count(released) == 1
        assert "being handed" not in (engine.waiting_reason(engine.jobs[ids[0]]) or "")
        assert not engine._handing
        await engine._pass()  # and now one decides
        assert engine.passes == passes + 1

    _on_started_engine(config, check)


@pytest.mark.usefixtures("small_chunks")
def test_a_requeue_during_the_handover_hands_everything_over_once() -> None:
    """A reload rebuilds the scheduler and calls requeue_all while a start's queue may still be
    arriving: it hands every pending job over itself, and the chunks left then hand nothing twice."""
    config, ids = _state_with_queue(QUEUED)

    async def check(engine: Engine) -> list[int] | None:
        await asyncio.sleep(0)  # the first chunk is in
        engine.requeue_all()
        assert not engine._handing and engine._arriving is not None
        await engine._arriving
        return fairness_order(engine.scheduler)

    order = _on_started_engine(config, check)
    assert order is not None and sorted(order) == ids


def test_a_short_queue_is_handed_over_inside_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """At or below HAND_OVER_LATER jobs the scheduler has them all when start() returns."""
    monkeypatch.setattr(engine_module, "HAND_OVER_LATER", QUEUED)
    config, ids = _state_with_queue(QUEUED)

    async def check(engine: Engine) -> list[int] | None:
        assert engine._arriving is None and not engine._handing
        return fairness_order(engine.scheduler)

    order = _on_started_engine(config, check)
    assert order is not None and sorted(order) == ids


@pytest.mark.usefixtures("small_chunks")
def test_jobs_of_a_queue_handed_over_late_run_in_the_order_they_would_have(monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end through `daemon_main.start`: every pass sees every pending job, and the queue runs
    on the one GPU in the scheduler's order (two users alternating, each in submission order)."""
    config, ids = _state_with_queue(QUEUED)
    partial: list[set[int]] = []
    snapshot: Callable[[Engine], object] = Engine.snapshot

    def watched(self: Engine) -> object:  # called by every pass that decides, right before it does
        waiting = {j.id for j in self.jobs.values() if j.state is JobState.PENDING}
        missing = waiting - set(fairness_order(self.scheduler) or [])
        if missing:
            partial.append(missing)
        return snapshot(self)

    monkeypatch.setattr(Engine, "snapshot", watched)

    async def go() -> list[int]:
        daemon = await daemon_main.start(config)
        try:
            deadline = time.monotonic() + 60
            while any((j := daemon.engine.get(i)) is None or j.state is not JobState.COMPLETED for i in ids):
                assert time.monotonic() < deadline, "the queue did not run within 60 s"
                await asyncio.sleep(0.02)
            started = {i: daemon.engine.store.get(i) for i in ids}
            return sorted(ids, key=lambda i: started[i].started_at or 0.0)  # type: ignore[union-attr]
        finally:
            await daemon_main.stop(daemon)

    try:
        order = asyncio.run(go())
    finally:
        kill_job_processes(config.state_dir)
    assert partial == []
    for user in (0, 1):  # each user's jobs in submission order (u0 has the even positions of `ids`)
        mine = [i for i in order if ids.index(i) % 2 == user]
        assert mine == sorted(mine) and len(mine) == QUEUED // 2
