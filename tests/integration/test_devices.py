"""GPU faults, drains and MIG layouts through the real daemon on simulated GPUs."""

from __future__ import annotations

from typing import Any

import pytest

from gpusched.config import GpuConfig
from gpusched.model import JobSpec, JobState, MigRequest
from gpusched.protocol import (
    CancelRequest,
    CancelResult,
    DevicesChanged,
    ErrorCode,
    GpuDrainRequest,
    GpuResumeRequest,
    GpusRequest,
    GpusResult,
    LogsRequest,
    LogsResult,
    MigApplyRequest,
    MigApplyResult,
    ProtocolError,
    ShowRequest,
    ShowResult,
    SimInjectXidRequest,
    SimResult,
)
from gpusched_cli.client import Client
from tests.conftest import DaemonHandle, kill_job_processes, wait_until
from tests.integration.test_daemon import spec, state_of, submit, wait_done


def mig_spec(profile: str, *argv: str, **kw: Any) -> JobSpec:
    return spec(*argv, **kw).model_copy(update={"request": MigRequest(profile=profile)})


def gpu_of(c: Client, job_id: int) -> int:
    job = c.call(ShowRequest(job_id=job_id), ShowResult).job
    assert job.allocation is not None
    return job.allocation.devices[0].gpu_index


def running(c: Client, job_id: int) -> bool:
    return state_of(c, job_id) is JobState.RUNNING


@pytest.fixture
def mig_daemon(daemon_factory: Any) -> DaemonHandle:
    """Two H100s: GPU 0 whole, GPU 1 with a static 3g+3g layout from the config."""
    return daemon_factory(gpus={"1": GpuConfig(mig=["3g.40gb", "3g.40gb"])})


def test_static_layout_from_config_and_mig_jobs_get_their_instance(mig_daemon: DaemonHandle) -> None:
    with mig_daemon.client() as c:
        gpus = c.call(GpusRequest(), GpusResult).gpus
        assert not gpus[0].mig_enabled
        assert gpus[1].mig_enabled
        assert [(i.profile, i.start, i.size) for i in gpus[1].instances] == [("3g.40gb", 0, 4), ("3g.40gb", 4, 4)]
        job_id = submit(c, mig_spec("3g.40gb", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES"))
        wait_done(c, job_id)
        uuid = c.call(LogsRequest(job_id=job_id), LogsResult).data.strip()
        assert uuid.startswith("MIG-") and uuid in {i.uuid for i in gpus[1].instances}
        job = c.call(ShowRequest(job_id=job_id), ShowResult).job
        assert job.allocation is not None and job.allocation.env["CUDA_VISIBLE_DEVICES"] == uuid
        assert job.allocation.compute_fraction == pytest.approx(60 / 132)


def test_mig_apply_changes_only_idle_instances_and_names_the_busy_job(mig_daemon: DaemonHandle) -> None:
    with mig_daemon.client() as c:
        busy = submit(c, mig_spec("3g.40gb", "sleep", "30"))
        wait_until(lambda: running(c, busy), what="mig job running")
        busy_uuid = c.call(ShowRequest(job_id=busy), ShowResult).job.allocation.uuids[0]  # type: ignore[union-attr]
        plan = c.call(MigApplyRequest(gpu=1, layout=["3g.40gb", "2g.20gb", "1g.10gb"], dry_run=True),
                      MigApplyResult)
        assert busy_uuid in plan.keep and not plan.applied
        assert len(plan.destroy) == 1 and busy_uuid not in plan.destroy
        assert sorted(p.profile for p in plan.create) == ["1g.10gb", "2g.20gb"]
        before = c.call(GpusRequest(), GpusResult).gpus[1].instances
        assert len(before) == 2  # the dry run changed nothing
        with pytest.raises(ProtocolError) as err:
            c.call(MigApplyRequest(gpu=1, layout=["7g.80gb"]), MigApplyResult)
        assert err.value.code is ErrorCode.INVALID_STATE and f"job {busy}" in err.value.message
        done = c.call(MigApplyRequest(gpu=1, layout=["3g.40gb", "2g.20gb", "1g.10gb"]), MigApplyResult)
        assert done.applied and len(done.log) == 3
        after = c.call(GpusRequest(), GpusResult).gpus[1].instances
        assert sorted(i.profile for i in after) == ["1g.10gb", "2g.20gb", "3g.40gb"]
        assert busy_uuid in {i.uuid for i in after} and running(c, busy)
        with pytest.raises(ProtocolError) as err:
            c.call(MigApplyRequest(gpu=0, layout=["7g.80gb"]), MigApplyResult)
        assert "not in MIG mode" in err.value.message
        c.call(CancelRequest(job_ids=[busy]), CancelResult)


def test_fatal_xid_fails_only_the_jobs_on_that_gpu_and_drains_it(daemon: DaemonHandle) -> None:
    with daemon.client() as c:
        a = submit(c, spec("sleep", "30"))
        b = submit(c, spec("sleep", "30", requeue=True))
        wait_until(lambda: running(c, a) and running(c, b), what="both running")
        victim, other = gpu_of(c, a), gpu_of(c, b)
        c.call(SimInjectXidRequest(gpu=victim, xid=79), SimResult)
        res = wait_done(c, a)
        assert res.job.state is JobState.FAILED and res.job.reason == "gpu_fault: XID 79"
        events = c.call(ShowRequest(job_id=a), ShowResult).events
        assert [e.kind for e in events] == ["drain"] and events[0].message == "gpu_fault: XID 79"
        assert running(c, b)  # the job on the other GPU is untouched
        gpus = {g.index: g for g in c.call(GpusRequest(), GpusResult).gpus}
        assert gpus[victim].health == "drained: gpu_fault: XID 79" and gpus[other].health == "ok"
        queued = submit(c, spec("true"))  # the only healthy GPU is busy, the drained one is skipped
        assert state_of(c, queued) is JobState.PENDING
        resumed = c.call(GpuResumeRequest(device=str(victim)), DevicesChanged)
        assert gpus[victim].uuid in resumed.devices
        assert wait_done(c, queued).job.state is JobState.COMPLETED
        assert gpu_of(c, queued) == victim
        c.call(CancelRequest(job_ids=[b]), CancelResult)


def test_fatal_xid_requeues_a_requeue_job(daemon: DaemonHandle) -> None:
    with daemon.client() as c:
        job_id = submit(c, spec("sleep", "30", requeue=True))
        wait_until(lambda: running(c, job_id), what="running")
        first_gpu = gpu_of(c, job_id)
        c.call(SimInjectXidRequest(gpu=first_gpu, xid=48), SimResult)
        def restarted() -> bool:  # one read: state and GPU of the same moment (two reads raced a requeue)
            job = c.call(ShowRequest(job_id=job_id), ShowResult).job
            return job.state is JobState.RUNNING and job.allocation is not None \
                and job.allocation.devices[0].gpu_index != first_gpu

        wait_until(restarted, what="restarted elsewhere")
        states = [t.state for t in c.call(ShowRequest(job_id=job_id), ShowResult).job.history]
        assert states[-4:] == [JobState.PREEMPTED, JobState.PENDING, JobState.STARTING, JobState.RUNNING]
        c.call(CancelRequest(job_ids=[job_id]), CancelResult)


def test_application_xid_is_recorded_but_changes_nothing(daemon: DaemonHandle) -> None:
    with daemon.client() as c:
        job_id = submit(c, spec("sleep", "30"))
        wait_until(lambda: running(c, job_id), what="running")
        c.call(SimInjectXidRequest(gpu=gpu_of(c, job_id), xid=13), SimResult)
        show = wait_until(lambda: c.call(ShowRequest(job_id=job_id), ShowResult).events and
                          c.call(ShowRequest(job_id=job_id), ShowResult), what="event recorded")
        assert [e.message for e in show.events] == ["app_error: XID 13"]
        assert running(c, job_id)
        assert all(g.health == "ok" for g in c.call(GpusRequest(), GpusResult).gpus)
        c.call(CancelRequest(job_ids=[job_id]), CancelResult)


def test_mig_scoped_xid_drains_only_that_instance(mig_daemon: DaemonHandle) -> None:
    with mig_daemon.client() as c:
        gpu = c.call(GpusRequest(), GpusResult).gpus[1]
        hit_job = submit(c, mig_spec("3g.40gb", "sleep", "30"))
        safe_job = submit(c, mig_spec("3g.40gb", "sleep", "30"))
        wait_until(lambda: running(c, hit_job) and running(c, safe_job), what="both running")
        hit_uuid = c.call(ShowRequest(job_id=hit_job), ShowResult).job.allocation.uuids[0]  # type: ignore[union-attr]
        gi = mig_daemon.call_in_loop(
            lambda: next(i.gi_id for g in mig_daemon.daemon.engine.inventory.gpus  # type: ignore[union-attr]
                         for i in g.instances if i.uuid == hit_uuid))
        c.call(SimInjectXidRequest(gpu=1, xid=94, gi=gi), SimResult)
        assert wait_done(c, hit_job).job.reason == f"gpu_fault: XID 94 on MIG GI {gi}"
        assert running(c, safe_job)
        health = {i.uuid: i.health for i in c.call(GpusRequest(), GpusResult).gpus[1].instances}
        assert health[hit_uuid].startswith("drained") and list(health.values()).count("ok") == 1
        assert c.call(GpusRequest(), GpusResult).gpus[1].health == "ok"
        assert gpu.index == 1
        c.call(CancelRequest(job_ids=[safe_job]), CancelResult)


def test_lost_gpu_fails_its_jobs_and_stays_drained_across_restart(daemon: DaemonHandle) -> None:
    with daemon.client() as c:
        job_id = submit(c, spec("sleep", "30"))
        wait_until(lambda: running(c, job_id), what="running")
        lost = gpu_of(c, job_id)
        c.call(SimInjectXidRequest(gpu=lost, xid=79, lost=True), SimResult)
        assert wait_done(c, job_id).job.reason.startswith("gpu_lost")
    daemon.restart()
    with daemon.client() as c:  # a fresh simulator has the GPU back, but the drain is remembered
        assert c.call(GpusRequest(), GpusResult).gpus[lost].health.startswith("drained: gpu_lost")


def test_drain_and_resume_need_an_admin_and_a_real_device(daemon: DaemonHandle) -> None:
    with daemon.client() as c:
        with pytest.raises(ProtocolError) as err:
            c.call(GpuDrainRequest(device="7"), DevicesChanged)
        assert err.value.code is ErrorCode.NOT_FOUND and "GPU indices: 0, 1" in err.value.message
        job_id = submit(c, spec("sleep", "30"))
        wait_until(lambda: running(c, job_id), what="running")
        drained = c.call(GpuDrainRequest(device=str(gpu_of(c, job_id)), reason="maintenance"), DevicesChanged)
        assert len(drained.devices) == 1
        assert running(c, job_id)  # an admin drain lets running jobs finish
        health = c.call(GpusRequest(), GpusResult).gpus[gpu_of(c, job_id)].health
        assert health == "drained: drained by root: maintenance"
        assert c.call(GpuResumeRequest(device=drained.devices[0]), DevicesChanged).devices == drained.devices
        c.call(CancelRequest(job_ids=[job_id]), CancelResult)


def test_a_restart_with_another_fixed_layout_keeps_the_instance_a_running_job_holds(tmp_path: Any) -> None:
    """The GPU keeps its instances across a daemon restart (the same simulated driver here, as real
    hardware would); a new `mig = [...]` applied at start must see the re-adopted job as busy."""
    import asyncio

    from gpusched.daemon import main as daemon_main
    from gpusched.gpu.nvml import NvmlBackend
    from gpusched.gpu.simnvml import SimNVML
    from tests.conftest import inprocess_config, short_tmpdir, wait_running

    base = short_tmpdir()
    common: dict[str, Any] = {"allow_root_jobs": True, "kill_grace_s": 2.0}
    driver = SimNVML.from_spec("H100-80GB:1")

    async def scenario() -> tuple[list[str], list[str], JobState | None]:
        two_halves = inprocess_config(base, **common, gpus={"0": GpuConfig(mig=["3g.40gb", "3g.40gb"])})
        first = await daemon_main.start(two_halves, backend=NvmlBackend(driver), backend_name="sim")
        made = await first.engine.submit(uid=0, gid=0, user="root", spec=mig_spec("3g.40gb", "sleep", "60"))
        job = await wait_running(first.engine, made.job_id)
        assert job.allocation is not None, "the MIG job did not start"
        held = job.allocation.uuids
        await daemon_main.stop(first)
        second = await daemon_main.start(inprocess_config(base, **common, gpus={"0": GpuConfig(mig=["7g.80gb"])}),
                                         backend=NvmlBackend(driver), backend_name="sim")
        try:
            instances = [i.uuid for g in second.engine.inventory.gpus for i in g.instances]
            again = second.engine.get(made.job_id)
            state = again.state if again is not None else None
            if again is not None:
                await second.engine.cancel(again, "test over")
        finally:
            await daemon_main.stop(second)
        return held, instances, state

    try:
        held, instances, state = asyncio.run(scenario())
    finally:
        kill_job_processes(inprocess_config(base).state_dir)
    assert state is JobState.RUNNING
    assert set(held) <= set(instances)  # its instance was kept: the new layout changed only idle ones
