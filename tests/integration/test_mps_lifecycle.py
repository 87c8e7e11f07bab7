"""The MPS control daemon of a user on a device, across that user's shares (isolation audit: a share
that started right after the same user's previous one ended ran with no control daemon, 4 times in 4,
so without its SM and memory caps on real CUDA)."""

from __future__ import annotations

import glob
import os
import time
from typing import Any

from gpusched.config import GpuConfig
from gpusched.model import JobSpec, JobState, ShareRequest
from gpusched.protocol import CancelRequest, CancelResult
from tests.conftest import wait_until
from tests.integration.test_daemon import state_of, submit, wait_done


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
