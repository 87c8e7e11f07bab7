"""What the scheduler counted survives a restart: the requeue-loss budget of the last day and each
job's preemption count (daemon/standing.py), beside the standing and the run-time history."""

from __future__ import annotations

import asyncio
import json
import os

from gpusched.core.scheduler import Scheduler, SchedulerConfig
from gpusched.daemon import main as daemon_main
from gpusched.daemon.store import Store
from gpusched.model import JobSpec, JobState, WholeRequest
from tests.conftest import inprocess_config, short_tmpdir


def test_preemption_records_round_trip_and_malformed_parts_are_skipped() -> None:
    before = Scheduler(SchedulerConfig(), incremental=True)
    before._budget.spend("alice", 1000.0, 600.0)
    before._times_preempted[7] = 2
    before.preempt_failed(9)  # its checkpoint failed
    saved = json.loads(json.dumps(before.export_preemptions()))
    after = Scheduler(SchedulerConfig(), incremental=True)
    after.load_preemptions(saved)
    assert after._budget.left("alice", 1000.0) == before._budget.left("alice", 1000.0) == 14400.0 - 600.0
    assert after._times_preempted == {7: 2} and after._no_checkpoint == {9}
    odd = Scheduler(SchedulerConfig(), incremental=True)
    odd.load_preemptions({"losses": {"bob": [[1, 2], "x", [1, "y"], [True, 3.0]], "eve": "no"},
                          "times": {"x": 1, "8": "two", "9": 1}})
    assert odd._budget.export() == {"bob": [[1.0, 2.0]]} and odd._times_preempted == {9: 1}


def test_a_restart_keeps_the_budget_spent_the_counts_and_the_interactive_demand() -> None:
    base = short_tmpdir()
    config = inprocess_config(base)

    async def first() -> float:
        daemon = await daemon_main.start(config)
        try:
            now = daemon.engine.clock()
            daemon.engine.scheduler._budget.spend("alice", now, 14000.0)
            daemon.engine.scheduler._times_preempted[42] = 1
            daemon.engine.scheduler._demand.observe(now - 60, 1.0)  # an interactive job ran a minute ago
            daemon.engine.scheduler._demand.observe(now - 30, 0.0)
            daemon.engine.scheduler._head_id = 77  # holding its place at the head (hold_head_after_s)
            daemon.engine.scheduler._last_reconfig[0] = now - 10  # GPU 0 was repartitioned 10 s ago
            return now
        finally:
            await daemon_main.stop(daemon)  # saves at shutdown

    async def second(now: float) -> tuple[float, dict[int, int], float, int | None]:
        daemon = await daemon_main.start(config)
        try:
            sched = daemon.engine.scheduler
            assert sched._last_reconfig == {0: now - 10}  # not repartitioned again before the interval
            return (sched._budget.left("alice", now), dict(sched._times_preempted), sched._demand.peak(now),
                    sched.export_held_head())
        finally:
            await daemon_main.stop(daemon)

    when = asyncio.run(first())
    left, times, peak, head = asyncio.run(second(when))
    assert left == 14400.0 - 14000.0 and times == {42: 1} and head == 77
    assert peak == 1.0  # the headroom is still kept for the interactive user of a minute ago
    store = Store(config.db_path)
    try:
        assert set(json.loads(store.get_meta("preemptions") or "{}")) == {"losses", "times", "no_checkpoint"}
    finally:
        store.close()


def test_interactive_demand_round_trips_and_malformed_samples_are_skipped() -> None:
    from gpusched.core.interactive import InteractiveDemand

    demand = InteractiveDemand(3600.0)
    demand.observe(100.0, 2.0)
    demand.observe(200.0, 0.5)
    again = InteractiveDemand(3600.0)
    again.load(json.loads(json.dumps(demand.export())))
    assert again.export() == demand.export() and again.peak(300.0) == 2.0
    odd = InteractiveDemand(3600.0)
    odd.load([[1, 2], "x", [True, 1], [3]])  # type: ignore[list-item]
    assert odd.export() == [[1.0, 2.0]]


def test_jobs_running_through_a_downtime_are_charged_for_it() -> None:
    """The saved standing charged running jobs up to its last pass; a scheduler loaded from it charges
    a job it finds running from then, so the GPU time used while no daemon ran is charged too."""
    from gpusched.core.actions import Snapshot
    from gpusched.model import AllocatedDevice, Allocation, Job, JobSpec, JobState, WholeRequest

    gpu = AllocatedDevice(uuid="GPU-0", gpu_index=0, kind="gpu", profile=None)
    spec = JobSpec(argv=["train"], cwd="/", request=WholeRequest(gpus=1))
    job = Job(id=1, uid=1000, gid=1000, user="alice", spec=spec, state=JobState.RUNNING, submitted_at=0.0,
              started_at=0.0, allocation=Allocation(devices=[gpu], compute_fraction=1.0))
    before = Scheduler(SchedulerConfig(), incremental=True)
    before.plan(Snapshot(gpus=(), pending=(), active=(job,)), now=100.0)
    standing, until = before.export_standing(), before.export_charged_until()
    assert until == 100.0
    after_restart = Scheduler(SchedulerConfig(), incremental=True)  # down from 100 s to 1,000 s
    after_restart.load_standing(standing)
    after_restart.load_charged_until(until)
    after_restart.plan(Snapshot(gpus=(), pending=(), active=(job,)), now=1000.0)
    forgetful = Scheduler(SchedulerConfig(), incremental=True)
    forgetful.load_standing(standing)
    forgetful.plan(Snapshot(gpus=(), pending=(), active=(job,)), now=1000.0)
    charged = after_restart.fair.export_standing()["alice"]["service"]
    assert charged - forgetful.fair.export_standing()["alice"]["service"] == 900.0  # the 900 s of downtime


def test_a_fresh_scheduler_takes_a_jobs_wait_from_its_history() -> None:
    """Released from hold at 500 s (or requeued then), a job has waited since 500 s, not since its
    submission: a restarted daemon's scheduler reads that off the history (the preemption bound
    and the held head count waits from there)."""
    from gpusched.model import Job, JobSpec, JobState, Transition, WholeRequest

    history = [Transition(state=JobState.PENDING, at=100.0, reason="submitted"),
               Transition(state=JobState.HELD, at=100.0, reason="held"),
               Transition(state=JobState.PENDING, at=500.0, reason="released")]
    job = Job(id=3, uid=1000, gid=1000, user="alice", state=JobState.PENDING, submitted_at=100.0, history=history,
              spec=JobSpec(argv=["train"], cwd="/", request=WholeRequest(gpus=1)))
    scheduler = Scheduler(SchedulerConfig(), incremental=True)
    scheduler.submit(job)  # before the first pass, as requeue_all does at a start
    assert scheduler._pending_since[3] == 500.0


def test_the_standing_a_start_was_charged_with_is_committed_in_its_starting_commit() -> None:
    """A pass that starts jobs saves the standing inside the STARTING commit (one COMMIT and fsync
    fewer on the start's path): durable exactly when the start is, never one without the other."""
    config = inprocess_config(short_tmpdir(), allow_root_jobs=True)
    spec = JobSpec(argv=["true"], cwd="/", request=WholeRequest(gpus=1))

    async def run() -> tuple[int, list[str]]:
        daemon = await daemon_main.start(config)
        statements: list[str] = []
        try:
            daemon.engine.store._db.set_trace_callback(statements.append)
            made = await daemon.engine.submit(uid=os.getuid(), gid=os.getgid(), user="me", spec=spec)
            for _ in range(400):
                job = daemon.engine.store.get(made.job_id)
                if job is not None and job.state is JobState.COMPLETED:
                    return made.job_id, statements
                await asyncio.sleep(0.025)
            raise AssertionError(f"job {made.job_id} did not complete: {job}")
        finally:
            daemon.engine.store._db.set_trace_callback(None)
            await daemon_main.stop(daemon)

    job_id, statements = asyncio.run(run())
    starting = next(i for i, s in enumerate(statements)
                    if s.startswith("UPDATE jobs SET state = 'STARTING'") and s.endswith(f"WHERE id = {job_id}"))
    commit = next(i for i in range(starting, len(statements)) if statements[i] == "COMMIT")
    begin = max(i for i in range(starting) if statements[i].startswith("BEGIN"))
    carried = [s for s in statements[begin:commit] if s.startswith("INSERT INTO meta")]
    assert any("'standing'" in s for s in carried), statements[begin:commit + 1]
    # and the pass made no COMMIT of its own for it between the submit and the start
    submitted = max(i for i in range(begin) if statements[i].startswith("INSERT INTO jobs"))
    assert not [s for s in statements[submitted:begin] if s.startswith("INSERT INTO meta")]
