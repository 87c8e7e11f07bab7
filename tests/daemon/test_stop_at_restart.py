"""A job cancelled while STARTING, whose launch never ran before the daemon went away, ends as
cancelled at the restart: it is not queued again, started, and only then killed."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from gpusched.daemon import main as daemon_main
from gpusched.daemon.store import Store
from gpusched.model import JobSpec, JobState, WholeRequest
from tests.conftest import inprocess_config, kill_job_processes, short_tmpdir


def test_a_cancel_saved_while_starting_ends_the_job_when_its_launch_never_ran() -> None:
    base = short_tmpdir()
    config = inprocess_config(base, allow_root_jobs=True)
    marker = os.path.join(base, "ran")

    async def create() -> None:
        await daemon_main.stop(await daemon_main.start(config))

    asyncio.run(create())
    # What a daemon that died between committing STARTING (and a cancel) and the launch leaves behind.
    store = Store(config.db_path)
    now = time.time()
    spec = JobSpec(argv=["sh", "-c", f"echo ran > {marker}"], cwd="/tmp", env={"PATH": os.environ["PATH"]},
                   request=WholeRequest(gpus=1))
    job = store.submit(uid=os.getuid(), gid=os.getgid(), user="me", spec=spec, now=now)
    job = store.transition(job, JobState.STARTING, now=now, reason="placed", started_at=now)
    store.set_meta("stop_requests", json.dumps({str(job.id): ["CANCELLED", "cancelled by me"]}))
    store.close()

    async def restart() -> tuple[list[tuple[JobState, str]], str | None]:
        daemon = await daemon_main.start(config)
        try:
            ended = daemon.engine.get(job.id)  # recovery runs inside start(): decided by now
            assert ended is not None
            return [(t.state, t.reason) for t in ended.history], daemon.engine.store.get_meta("stop_requests")
        finally:
            await daemon_main.stop(daemon)

    try:
        history, stops = asyncio.run(restart())
    finally:
        kill_job_processes(config.state_dir)
    assert [s for s, _ in history] == [JobState.PENDING, JobState.STARTING, JobState.CANCELLED]
    assert history[-1][1] == "cancelled by me (before its launch ran)"
    assert json.loads(stops or "{}") == {} and not os.path.exists(marker)


def test_a_job_adopted_from_starting_at_a_restart_has_run_since_its_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon died after the launch and before committing RUNNING: at the restart the job is
    adopted, and its RUNNING starts at its launch, so its time limit counts the downtime too."""
    from gpusched.daemon.launch import Launcher

    base = short_tmpdir()
    config = inprocess_config(base, allow_root_jobs=True)
    spec = JobSpec(argv=["sleep", "60"], cwd="/tmp", env={"PATH": os.environ["PATH"]},
                   request=WholeRequest(gpus=1), time_limit_s=3600.0)
    real_start = Launcher.start

    async def launch_then_die(self: Launcher, *args: object, **kwargs: object) -> object:
        await real_start(self, *args, **kwargs)  # type: ignore[arg-type]
        await asyncio.Event().wait()  # the daemon goes away before it commits RUNNING
        raise AssertionError("unreachable")

    async def first() -> tuple[int, float]:
        monkeypatch.setattr(Launcher, "start", launch_then_die)
        daemon = await daemon_main.start(config)
        try:
            made = await daemon.engine.submit(uid=os.getuid(), gid=os.getgid(), user="me", spec=spec)
            for _ in range(400):
                started = daemon.engine.get(made.job_id)
                if started is not None and started.state is JobState.STARTING and daemon.engine.executor.inspect(
                        made.job_id).job_alive:
                    break
                await asyncio.sleep(0.025)
            assert started is not None and started.started_at is not None, "the launch did not happen"
            return made.job_id, started.started_at
        finally:
            await daemon_main.stop(daemon)
            monkeypatch.setattr(Launcher, "start", real_start)

    async def second(job_id: int) -> list[tuple[JobState, float]]:
        daemon = await daemon_main.start(config)
        try:
            adopted = daemon.engine.get(job_id)
            assert adopted is not None
            history = [(t.state, t.at) for t in adopted.history]
            await daemon.engine.cancel(adopted, "test over")
            return history
        finally:
            await daemon_main.stop(daemon)

    try:
        job_id, launched_at = asyncio.run(first())
        history = asyncio.run(second(job_id))
    finally:
        kill_job_processes(config.state_dir)
    assert [s for s, _ in history] == [JobState.PENDING, JobState.STARTING, JobState.RUNNING]
    assert history[-1][1] == launched_at  # not the restart's time
