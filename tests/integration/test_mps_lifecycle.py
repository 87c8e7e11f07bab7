"""The MPS control daemon of a user on a device, across that user's shares (isolation audit: a share
that started right after the same user's previous one ended ran with no control daemon, 4 times in 4,
so without its SM and memory caps on real CUDA)."""

from __future__ import annotations

import glob
import os
import time
from typing import TYPE_CHECKING, Any

from gpusched.config import GpuConfig
from gpusched.model import JobSpec, JobState, ShareRequest
from gpusched.protocol import CancelRequest, CancelResult
from tests.conftest import wait_until
from tests.integration.test_daemon import state_of, submit, wait_done

if TYPE_CHECKING:
    from gpusched.gpu.mps import MpsDaemon


def _share(cmd: str, fraction: float, mem: int = 1024, **kw: Any) -> JobSpec:
    return JobSpec(argv=["sh", "-c", cmd], cwd="/tmp", env={"PATH": "/usr/bin:/bin", **kw.pop("env", {})},
                   request=ShareRequest(fraction=fraction, gpu_mem_mib=mem), **kw)


def _alive_control_daemons(state_dir: str) -> list[int]:
    out = []
    for pid_file in glob.glob(os.path.join(state_dir, "mps", "*", "pipe", "nvidia-cuda-mps-control.pid")):
        try:
            with open(pid_file) as f:
                pid = int(f.read().strip())
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            if stat.rpartition(")")[2].split()[0] != "Z":
                out.append(pid)
        except (OSError, ValueError):
            pass
    return out


def test_mps_daemon_alive_for_the_next_share_of_the_same_user(daemon_factory: Any) -> None:
    """Job A ends, job B (same user, same MPS device) starts right away: B must have a live MPS
    control daemon behind its CUDA_MPS_PIPE_DIRECTORY for as long as it runs."""
    d = daemon_factory(sim="H100-80GB:1", gpus={"0": GpuConfig(share="mps")})
    with d.client() as c:
        failures = 0
        for _ in range(4):
            submit(c, _share("sleep 0.5", 0.6))
            b = submit(c, _share("sleep 30", 0.6))
            wait_until(lambda b=b: state_of(c, b) is JobState.RUNNING, timeout=20, what="B running")
            time.sleep(1.5)  # any stop decided when A ended has long finished by now (it raced B's start)
            if not _alive_control_daemons(d.state_dir):
                failures += 1
            c.call(CancelRequest(job_ids=[b]), CancelResult)
            wait_done(c, b)
            wait_until(lambda: not _alive_control_daemons(d.state_dir), timeout=15, what="daemon stopped")
        assert failures == 0, f"{failures}/4 times B ran with no MPS control daemon"


def test_mps_daemon_stopped_after_cancel_and_timeout(daemon_factory: Any) -> None:
    d = daemon_factory(sim="H100-80GB:1", gpus={"0": GpuConfig(share="mps")})
    with d.client() as c:
        a = submit(c, _share("sleep 60", 0.5))
        wait_until(lambda: state_of(c, a) is JobState.RUNNING, what="running")
        c.call(CancelRequest(job_ids=[a]), CancelResult)
        wait_done(c, a)
        wait_until(lambda: not _alive_control_daemons(d.state_dir), timeout=10, what="stopped after cancel")
        b = submit(c, _share("sleep 60", 0.5, time_limit_s=1))
        assert wait_done(c, b).job.state is JobState.TIMEOUT
        wait_until(lambda: not _alive_control_daemons(d.state_dir), timeout=10, what="stopped after timeout")


def test_cpus_are_pinned_when_the_cgroup_has_no_cpu_controllers(daemon_factory: Any, tmp_path: Any) -> None:
    """A delegated subtree offering only memory: `--cpus 1` ran on every CPU (isolation audit); the
    user guide promises that without CPU limits the job is pinned to N CPUs near its GPU."""
    from gpusched.model import WholeRequest
    from gpusched.protocol import LogsRequest, LogsResult
    from tests.daemon.test_cgroups import fake_cgroupfs

    if len(os.sched_getaffinity(0)) < 2:
        import pytest
        pytest.skip("one CPU: pinning to one changes nothing")
    root = fake_cgroupfs(tmp_path / "gpusched.service", controllers="memory pids")
    d = daemon_factory(sim="H100-80GB:1", cgroup_root=str(root))
    with d.client() as c:
        spec = JobSpec(argv=["sh", "-c", "grep Cpus_allowed_list /proc/self/status"], cwd="/tmp",
                       env={"PATH": "/usr/bin:/bin"}, request=WholeRequest(gpus=1), cpus=1, mem_mib=512)
        job = submit(c, spec)
        wait_done(c, job)
        out = c.call(LogsRequest(job_id=job), LogsResult).data
    assert (root / f"job-{job}" / "memory.max").read_text() == str(512 << 20)  # the memory limit is the cgroup's
    assert out.split()[-1].isdigit(), f"a --cpus 1 job may run on CPUs {out.split()[-1]}"


def _control(state_dir: str, device: str) -> MpsDaemon:
    """The control daemon of this test's user on a device, as gpuschedd laid it out."""
    from gpusched.gpu.mps import MpsDaemon, daemon_dir
    from gpusched.gpu.simmps import __file__ as fake

    return MpsDaemon.found_at(daemon_dir(os.path.join(state_dir, "mps"), device, os.getuid()), control_binary=fake)


def _device_of(c: Any, job_id: int) -> str:
    from gpusched.protocol import ShowRequest, ShowResult

    job = c.call(ShowRequest(job_id=job_id), ShowResult).job
    assert job.allocation is not None
    return job.allocation.uuids[0]


def _caps(ctl: MpsDaemon, device: str) -> tuple[str, str]:
    return (ctl.command("get_default_active_thread_percentage"),
            ctl.command(f"get_default_device_pinned_mem_limit {device}"))


def test_the_control_daemon_caps_a_client_at_its_users_shares(daemon_factory: Any) -> None:
    """A job's CUDA_MPS_* variables can only lower its daemon's caps, and gpusched left those at
    100% and no memory limit (isolation audit): a job that exported CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
    =100 itself got the whole GPU beside another user's share. The daemon's caps are now the user's
    shares on the device together, and follow them as they start and end."""
    d = daemon_factory(sim="H100-80GB:1", gpus={"0": GpuConfig(share="mps")})
    with d.client() as c:
        a = submit(c, _share("sleep 60", 0.3, mem=2048))
        wait_until(lambda: state_of(c, a) is JobState.RUNNING, what="A running")
        device = _device_of(c, a)
        ctl = _control(d.state_dir, device)
        assert _caps(ctl, device) == ("30.0", "2048M")
        b = submit(c, _share("sleep 60", 0.2, mem=1024))
        wait_until(lambda: state_of(c, b) is JobState.RUNNING, what="B running")
        assert _caps(ctl, device) == ("50.0", "3072M")
        c.call(CancelRequest(job_ids=[a]), CancelResult)
        wait_done(c, a)
        wait_until(lambda: _caps(ctl, device) == ("20.0", "1024M"), timeout=10, what="caps lowered to B's")
        c.call(CancelRequest(job_ids=[b]), CancelResult)
        wait_done(c, b)
        wait_until(lambda: not _alive_control_daemons(d.state_dir), timeout=10, what="daemon quit")


def test_a_share_readopted_after_a_restart_still_quits_its_control_daemon(daemon_factory: Any) -> None:
    """Control daemons of shares found running at start were never registered, so they outlived
    their shares for good (isolation audit)."""
    d = daemon_factory(sim="H100-80GB:1", gpus={"0": GpuConfig(share="mps")})
    with d.client() as c:
        a = submit(c, _share("sleep 60", 0.4))
        wait_until(lambda: state_of(c, a) is JobState.RUNNING, what="running")
    assert _alive_control_daemons(d.state_dir)
    d.restart()
    with d.client() as c:
        assert state_of(c, a) is JobState.RUNNING
        c.call(CancelRequest(job_ids=[a]), CancelResult)
        wait_done(c, a)
    wait_until(lambda: not _alive_control_daemons(d.state_dir), timeout=10, what="daemon quit after re-adoption")


def test_a_control_daemon_no_share_needs_is_quit_at_start(daemon_factory: Any) -> None:
    """A share that ended while no gpuschedd ran (or one that crashed before quitting its daemon)
    leaves a control daemon nobody would quit: the next start quits it, and keeps the ones in use."""
    d = daemon_factory(sim="H100-80GB:1", gpus={"0": GpuConfig(share="mps")})
    with d.client() as c:
        a = submit(c, _share("sleep 60", 0.4))
        wait_until(lambda: state_of(c, a) is JobState.RUNNING, what="running")
        device = _device_of(c, a)
    d.stop()
    from gpusched.gpu.mps import MpsDaemon
    from gpusched.gpu.simmps import __file__ as fake

    stray = MpsDaemon("GPU-not-in-use", os.path.join(d.state_dir, "mps"), uid=os.getuid(), control_binary=fake)
    stray.start()
    stray_pid = stray.pid()
    kept = _control(d.state_dir, device).pid()
    assert stray_pid is not None and kept is not None
    d.start()
    wait_until(lambda: stray_pid not in _alive_control_daemons(d.state_dir), timeout=10, what="stray quit")
    assert kept in _alive_control_daemons(d.state_dir)
    with d.client() as c:
        assert state_of(c, a) is JobState.RUNNING
        assert _caps(_control(d.state_dir, device), device) == ("40.0", "1024M")
