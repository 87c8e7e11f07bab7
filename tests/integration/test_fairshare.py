"""The fair-share scheduler inside the real daemon: users, weights, shares, MPS, dynamic MIG, standing."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from typing import Any

import pytest

from gpusched.config import GpuConfig
from gpusched.daemon.devices import simulator_of
from gpusched.model import JobSpec, JobState, MigRequest, ShareRequest, WholeRequest
from gpusched.protocol import (
    CancelRequest,
    CancelResult,
    GpusRequest,
    GpusResult,
    LogsRequest,
    LogsResult,
    QueueRequest,
    QueueResult,
    ShowRequest,
    ShowResult,
    StatsRequest,
    StatsResult,
    TopSnapshot,
)
from gpusched_cli.client import Client
from tests.conftest import DaemonHandle, wait_until
from tests.integration.test_daemon import spec, state_of, submit, wait_done
from tests.integration.test_identity import as_user

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")


def user_spec(*argv: str, **request: Any) -> dict[str, Any]:
    req = ShareRequest(**request) if "fraction" in request else WholeRequest(gpus=request.get("gpus", 1))
    s = JobSpec(argv=list(argv), cwd="/tmp", env={"PATH": "/usr/bin:/bin"}, request=req)
    return {"op": "submit", "spec": s.model_dump(mode="json")}


def started(c: Client, job_id: int) -> bool:
    return c.call(ShowRequest(job_id=job_id), ShowResult).job.started_at is not None


@needs_root
def test_a_second_user_overtakes_a_long_backlog(daemon: DaemonHandle) -> None:
    with daemon.client() as c:
        backlog = [submit(c, spec("sleep", "0.4")) for _ in range(16)]  # root: 16 jobs for 2 GPUs
        replies = as_user(12345, daemon.socket, *[user_spec("sleep", "0.2") for _ in range(3)])
        theirs = [r["result"]["job_id"] for r in replies]
        wait_until(lambda: all(started(c, j) for j in theirs), timeout=30, what="second user's jobs started")
        still_waiting = sum(1 for j in backlog if not started(c, j))
        # FIFO would start them only after all 16; fair share starts them within the first rounds.
        assert still_waiting >= 8, f"only {still_waiting} of root's jobs were still waiting"
        c.call(CancelRequest(job_ids=backlog), CancelResult)
        for j in theirs:
            assert wait_done(c, j).job.state is JobState.COMPLETED


def test_queue_by_fairness_order_and_waiting_reason(daemon_factory: Any) -> None:
    daemon = daemon_factory(fairness={"weights": {"root": 300}})
    with daemon.client() as c:
        blocker = submit(c, spec("sleep", "30", gpus=2))
        wait_until(lambda: state_of(c, blocker) is JobState.RUNNING, what="blocker")
        batch = submit(c, spec("true", nice=5))
        urgent = submit(c, spec("true"))
        rows = c.call(QueueRequest(order="fairness"), QueueResult).jobs
        assert [r.id for r in rows] == [blocker, urgent, batch]  # nice orders a user's own jobs
        reason = c.call(ShowRequest(job_id=batch), ShowResult).waiting_reason or ""
        assert reason and "waiting" in reason.lower()
        c.call(CancelRequest(job_ids=[blocker, batch, urgent]), CancelResult)


def test_mps_shares_run_side_by_side_with_caps_and_one_uid_at_a_time(daemon_factory: Any) -> None:
    daemon = daemon_factory(sim="H100-80GB:1", gpus={"0": GpuConfig(share="mps")})
    env_cmd = "echo $CUDA_MPS_ACTIVE_THREAD_PERCENTAGE $CUDA_MPS_PINNED_DEVICE_MEM_LIMIT; sleep 30"
    with daemon.client() as c:
        share = JobSpec(argv=["sh", "-c", env_cmd], cwd="/tmp", env={"PATH": "/usr/bin:/bin"},
                        request=ShareRequest(fraction=0.5, gpu_mem_mib=10240))
        a, b = submit(c, share), submit(c, share)
        wait_until(lambda: state_of(c, a) is JobState.RUNNING and state_of(c, b) is JobState.RUNNING,
                   what="two shares co-resident")
        wait_until(lambda: c.call(LogsRequest(job_id=a), LogsResult).data, what="output")
        assert c.call(LogsRequest(job_id=a), LogsResult).data.strip() == "50 0=10240M"
        job = c.call(ShowRequest(job_id=a), ShowResult).job
        assert job.allocation is not None and job.allocation.share == 0.5
        assert job.allocation.env["CUDA_MPS_PIPE_DIRECTORY"].startswith(daemon.state_dir)
        third = submit(c, share)  # the GPU's compute is fully shared out
        assert state_of(c, third) is JobState.PENDING
        if os.geteuid() == 0:
            [other] = as_user(12345, daemon.socket, user_spec("true", fraction=0.25, gpu_mem_mib=1024))
            other_id = other["result"]["job_id"]
            c.call(CancelRequest(job_ids=[third]), CancelResult)
            c.call(CancelRequest(job_ids=[b]), CancelResult)
            wait_done(c, b)
            assert state_of(c, other_id) is JobState.PENDING  # root still owns the MPS server via job a
            c.call(CancelRequest(job_ids=[a]), CancelResult)
            assert wait_done(c, other_id).job.state is JobState.COMPLETED
        else:
            c.call(CancelRequest(job_ids=[a, b, third]), CancelResult)


def test_timeslice_job_over_its_gpu_memory_is_ended(daemon_factory: Any) -> None:
    daemon = daemon_factory(sim="H100-80GB:1", gpus={"0": GpuConfig(share="timeslice")})
    with daemon.client() as c:
        share = JobSpec(argv=["sleep", "30"], cwd="/tmp", env={"PATH": "/usr/bin:/bin"},
                        request=ShareRequest(fraction=0.5, gpu_mem_mib=1024))
        job_id = submit(c, share)
        wait_until(lambda: state_of(c, job_id) is JobState.RUNNING, what="running")
        job = c.call(ShowRequest(job_id=job_id), ShowResult).job
        assert daemon.daemon is not None and job.pid is not None
        sim = simulator_of(daemon.daemon.engine.backend)
        assert sim is not None
        gpu_uuid = c.call(GpusRequest(), GpusResult).gpus[0].uuid
        sim.add_process(gpu_uuid, job.pid, 512 << 20)  # within its 1 GiB: nothing happens
        daemon.call_in_loop(lambda: None)
        assert state_of(c, job_id) is JobState.RUNNING
        sim.remove_process(job.pid)
        sim.add_process(gpu_uuid, job.pid, 3 << 30)  # now 3 GiB
        res = wait_done(c, job_id)
        assert res.job.state is JobState.FAILED
        assert res.job.reason == "gpu_mem exceeded: its processes use 3072 MiB, over its --gpu-mem of 1024 MiB"


def test_dynamic_mig_creates_the_instance_a_job_asks_for(daemon_factory: Any) -> None:
    daemon = daemon_factory(sim="H100-80GB:1", gpus={"0": GpuConfig(mig="dynamic")})
    with daemon.client() as c:
        assert c.call(GpusRequest(), GpusResult).gpus[0].mig_enabled
        job_id = submit(c, spec("true").model_copy(update={"request": MigRequest(profile="3g.40gb")}))
        res = wait_done(c, job_id)
        assert res.job.state is JobState.COMPLETED
        profiles = [i.profile for i in c.call(GpusRequest(), GpusResult).gpus[0].instances]
        assert "3g.40gb" in profiles


def test_standing_survives_a_restart(daemon: DaemonHandle) -> None:
    with daemon.client() as c:
        job_id = submit(c, spec("sleep", "0.5", gpus=2))
        wait_done(c, job_id)
    assert daemon.daemon is not None
    before = daemon.call_in_loop(lambda: daemon.daemon.engine.scheduler.export_standing())  # type: ignore[union-attr]
    assert before["root"]["service"] > 0.5
    daemon.restart()
    stored = json.loads(daemon.daemon.store.get_meta("standing") or "{}")  # type: ignore[union-attr]
    after = daemon.call_in_loop(lambda: daemon.daemon.engine.scheduler.export_standing())  # type: ignore[union-attr]
    assert stored["root"]["service"] == pytest.approx(before["root"]["service"])
    assert after["root"]["service"] == pytest.approx(before["root"]["service"])


def _start_order(c: Client, job_ids: list[int]) -> list[int]:
    jobs = [c.call(ShowRequest(job_id=j), ShowResult).job for j in job_ids]
    return [j.id for j in sorted((j for j in jobs if j.started_at is not None), key=lambda j: (j.started_at, j.id))]


@needs_root
def test_weights_hold_for_one_second_jobs(daemon_factory: Any) -> None:
    """Issue 11: weights 300:100, both users backlogged with short jobs -> 3:1 of the first 20 starts.

    With a charge that only grows while jobs run, whoever just finished looked most owed and the
    starts alternated 1:1; a start now commits its expected service at once."""
    daemon = daemon_factory(fairness={"weights": {"20003": 300, "20004": 100}})
    with daemon.client() as c:
        blocker = submit(c, spec("sleep", "60", gpus=2))  # holds both GPUs while the queues fill
        wait_until(lambda: state_of(c, blocker) is JobState.RUNNING, what="blocker running")
        heavy = [r["result"]["job_id"] for r in as_user(20003, daemon.socket,
                                                        *[user_spec("sleep", "0.5") for _ in range(20)])]
        light = [r["result"]["job_id"] for r in as_user(20004, daemon.socket,
                                                        *[user_spec("sleep", "0.5") for _ in range(20)])]
        predicted = [r.id for r in c.call(QueueRequest(order="fairness"), QueueResult).jobs if r.id != blocker]
        c.call(CancelRequest(job_ids=[blocker]), CancelResult)
        wait_until(lambda: len(_start_order(c, heavy + light)) >= 20, timeout=60, what="20 starts")
        first = _start_order(c, heavy + light)[:20]
        heavy_starts = sum(1 for j in first if j in heavy)
        assert 14 <= heavy_starts <= 16, f"weight-300 user got {heavy_starts} of the first 20 starts: {first}"
        # `queue --order fairness` made the same 3:1 prediction before anything ran.
        assert 14 <= sum(1 for j in predicted[:20] if j in heavy) <= 16
        c.call(CancelRequest(job_ids=heavy + light), CancelResult)


def test_show_gives_the_estimate_and_expected_start(daemon: DaemonHandle) -> None:
    with daemon.client() as c:
        first = submit(c, spec("sleep", "0.3", gpus=2))
        wait_done(c, first)  # history: 'sleep 0.3' runs about 0.3 s
        blocker = submit(c, spec("sleep", "60", gpus=2))
        wait_until(lambda: state_of(c, blocker) is JobState.RUNNING, what="blocker running")
        waiting = submit(c, spec("sleep", "0.3", gpus=2))
        shown = c.call(ShowRequest(job_id=waiting), ShowResult)
        assert shown.estimate is not None
        assert 0.2 < shown.estimate.runtime_s < 5, shown.estimate
        assert "this command" in shown.estimate.source
        running = c.call(ShowRequest(job_id=blocker), ShowResult).estimate
        assert running is not None and running.expected_end_at is not None
        # The waiting job starts when the blocker is expected to end (its default estimate).
        assert shown.estimate.expected_start_at == pytest.approx(running.expected_end_at, abs=1.0)
        c.call(CancelRequest(job_ids=[blocker, waiting]), CancelResult)


def test_a_batch_jobs_expected_start_leaves_out_interactive_only_gpus(daemon_factory: Any) -> None:
    """`show` gave "now" for a batch job that could only wait: the expected start counted the idle
    interactive-only GPU as free, and "(1 idle now)" did not say it was kept (scheduling audit)."""
    node = daemon_factory(sim="H100-80GB:2", gpus={"1": GpuConfig(interactive=True)})
    with node.client() as c:
        first = submit(c, spec("sleep", "60"))
        wait_until(lambda: state_of(c, first) is JobState.RUNNING, what="the first job running")
        second = submit(c, spec("sleep", "60"))
        shown = wait_until(lambda: (s := c.call(ShowRequest(job_id=second), ShowResult)).estimate and s,
                           what="an estimate for the second job")
        end_first = c.call(ShowRequest(job_id=first), ShowResult).estimate
        c.call(CancelRequest(job_ids=[first, second]), CancelResult)
    assert shown.job.state is JobState.PENDING and end_first is not None
    assert shown.estimate.expected_start_at == pytest.approx(end_first.expected_end_at, abs=1.0)
    assert "(1 idle now, 1 of them kept for interactive work)" in (shown.waiting_reason or ""), shown.waiting_reason


def _spec_msg(argv: list[str], request: Any, **fields: Any) -> dict[str, Any]:
    s = JobSpec(argv=argv, cwd="/tmp", env={"PATH": "/usr/bin:/bin"}, request=request, **fields)
    return {"op": "submit", "spec": s.model_dump(mode="json")}


@needs_root
def test_interactive_users_get_a_gpu_from_a_backlogged_trainer(daemon_factory: Any) -> None:
    """Issue 11, the seed's story in the live daemon: a trainer's --requeue jobs hold every GPU; an
    interactive share preempts one (the headroom), and a second user's interactive share joins it
    on the same device under its own MPS server, while the trainer's backlog waits. Checkpointing
    off: the victim is requeued (test_checkpoint.py has the same story with nothing lost)."""
    daemon = daemon_factory(sim="H100-80GB:2", gpus={"0": GpuConfig(share="mps"), "1": GpuConfig(share="mps")},
                            checkpoint=False)
    trainer = [r["result"]["job_id"] for r in as_user(20010, daemon.socket, *[
        _spec_msg(["sleep", "120"], WholeRequest(gpus=1), requeue=True, name="train") for _ in range(3)])]
    with daemon.client() as c:
        wait_until(lambda: sum(state_of(c, j) is JobState.RUNNING for j in trainer) == 2, what="trainer on both GPUs")
        share = ShareRequest(fraction=0.1, gpu_mem_mib=4096)
        [alice] = [r["result"]["job_id"] for r in as_user(20011, daemon.socket, _spec_msg(
            ["sh", "-c", "echo $CUDA_MPS_PIPE_DIRECTORY; sleep 60"], share, job_class="interactive"))]
        wait_until(lambda: state_of(c, alice) is JobState.RUNNING, timeout=30, what="interactive job started")
        [bob] = [r["result"]["job_id"] for r in as_user(20012, daemon.socket, _spec_msg(
            ["sh", "-c", "echo $CUDA_MPS_PIPE_DIRECTORY; sleep 60"], share, job_class="interactive"))]
        wait_until(lambda: state_of(c, bob) is JobState.RUNNING, timeout=30, what="second interactive job started")
        a = c.call(ShowRequest(job_id=alice), ShowResult).job
        b = c.call(ShowRequest(job_id=bob), ShowResult).job
        assert a.allocation is not None and b.allocation is not None
        assert a.allocation.uuids == b.allocation.uuids  # one device, two users
        assert a.allocation.env["CUDA_MPS_PIPE_DIRECTORY"] != b.allocation.env["CUDA_MPS_PIPE_DIRECTORY"]
        history = [tr for j in trainer for tr in c.call(ShowRequest(job_id=j), ShowResult).job.history]
        preempted = [tr.reason for tr in history if tr.state is JobState.PREEMPTED]
        assert len(preempted) == 1 and "requeued" in preempted[0] and "interactive" in preempted[0], preempted
        assert sum(state_of(c, j) is JobState.RUNNING for j in trainer) == 1  # the other GPU is the headroom
        c.call(CancelRequest(job_ids=[*trainer, alice, bob]), CancelResult)


def test_dynamic_gpus_leave_mig_mode_for_a_whole_gpu_job_and_return_for_mig_work(daemon_factory: Any) -> None:
    """Issue 11: idle dynamic GPUs switch MIG mode from demand in the live daemon (SimNVML's
    nvmlDeviceSetMigMode), with events that say why."""
    daemon = daemon_factory(sim="H100-80GB:2", gpus={"0": GpuConfig(mig="dynamic"), "1": GpuConfig(mig="dynamic")},
                            mig={"min_idle_s": 0.0, "min_reconfig_interval_s": 0.0})
    with daemon.client() as c:
        assert all(g.mig_enabled for g in c.call(GpusRequest(), GpusResult).gpus)
        pod = submit(c, spec("true", gpus=2))
        assert wait_done(c, pod).job.state is JobState.COMPLETED
        assert not any(g.mig_enabled for g in c.call(GpusRequest(), GpusResult).gpus)
        small = submit(c, spec("true").model_copy(update={"request": MigRequest(profile="1g.10gb")}))
        assert wait_done(c, small).job.state is JobState.COMPLETED
        modes = [g.mig_enabled for g in c.call(GpusRequest(), GpusResult).gpus]
        assert modes.count(True) == 1
    assert daemon.daemon is not None
    events = [e for e in daemon.daemon.store.events(limit=50) if e.kind == "mig_mode"]
    assert [e.message.split(":")[0] for e in events] == ["MIG mode off", "MIG mode off", "MIG mode on"]
    assert f"job {pod} needs 2 whole GPU(s)" in events[0].message


def test_stats_and_top_show_a_group_members_share_of_the_group_weight(daemon_factory: Any) -> None:
    """With [fairness.groups], a member's weight is the group's (split among its active members):
    `stats` and `top` must show that, not the member's own configured weight."""
    daemon = daemon_factory(fairness={"groups": {"root": "lab"}, "group_weights": {"lab": 1000}})
    with daemon.client() as c:
        blocker = submit(c, spec("sleep", "30", gpus=2))
        wait_until(lambda: state_of(c, blocker) is JobState.RUNNING, what="job running")
        [root] = c.call(StatsRequest(), StatsResult).users
        assert root.weight == 1000
        c.call(CancelRequest(job_ids=[blocker]), CancelResult)
    with daemon.client() as c:  # `top`'s stream, first snapshot (taken while the job is still there or not)
        snapshot = TopSnapshot.model_validate(c.request({"op": "watch", "max_rate_hz": 20}))
    assert all(u.weight == 1000 for u in snapshot.users if u.user == root.user)


def test_a_timeslice_process_that_left_its_session_still_counts_against_the_job(
        daemon_factory: Any, tmp_path: Any) -> None:
    """The watchdog counted a job's session only: a process that called setsid() used GPU memory
    beyond the job's --gpu-mem unseen (isolation audit). With per-job cgroups it is the cgroup's
    members that count, and a job cannot leave its cgroup (the fake cgroupfs lists the escaped
    process in the job's cgroup.procs, as the kernel would: it was forked there)."""
    from tests.daemon.test_cgroups import fake_cgroupfs

    root = fake_cgroupfs(tmp_path / "gpusched.service")
    daemon = daemon_factory(sim="H100-80GB:1", gpus={"0": GpuConfig(share="timeslice")}, cgroup_root=str(root))
    pid_file = tmp_path / "escaped.pid"
    with daemon.client() as c:
        share = JobSpec(argv=["sh", "-c", f"setsid sleep 60 & echo $! > {pid_file}; sleep 60"], cwd="/tmp",
                        env={"PATH": "/usr/bin:/bin"}, request=ShareRequest(fraction=0.5, gpu_mem_mib=1024))
        job_id = submit(c, share)
        wait_until(lambda: state_of(c, job_id) is JobState.RUNNING and pid_file.exists()
                   and pid_file.read_text().strip().isdigit(), what="running, with a process out of its session")
        escaped = int(pid_file.read_text())
        job = c.call(ShowRequest(job_id=job_id), ShowResult).job
        assert job.pid is not None
        # `$!` is written as soon as the shell forked; setsid(1) leaves the session a moment later
        wait_until(lambda: os.getsid(escaped) != job.pid, what="the background process out of the job's session")
        with open(root / f"job-{job_id}" / "cgroup.procs", "a") as f:
            f.write(f"\n{escaped}\n")
        assert daemon.daemon is not None
        sim = simulator_of(daemon.daemon.engine.backend)
        assert sim is not None
        sim.add_process(c.call(GpusRequest(), GpusResult).gpus[0].uuid, escaped, 3 << 30)
        try:
            res = wait_done(c, job_id)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(escaped, signal.SIGKILL)
        assert res.job.state is JobState.FAILED
        assert res.job.reason == "gpu_mem exceeded: its processes use 3072 MiB, over its --gpu-mem of 1024 MiB"
