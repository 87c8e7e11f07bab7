"""GPU faults while jobs run on every kind of device: only the affected device's jobs are touched.

One node, three simulated H100s: GPU 0 whole, GPU 1 split into MIG instances, GPU 2 shared through
MPS. Jobs run everywhere; then, one after another, an application XID, a fatal XID scoped to one MIG
instance, a failed MIG create, the death of an MPS control daemon, and a lost GPU. After each, the
jobs on other devices must still be running, and at the end they must finish normally.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from gpusched.config import GpuConfig
from gpusched.daemon.devices import simulator_of
from gpusched.model import JobSpec, JobState, MigRequest, ShareRequest, WholeRequest
from gpusched.protocol import (
    GpusRequest,
    GpusResult,
    MigApplyRequest,
    MigApplyResult,
    ProtocolError,
    ShowRequest,
    ShowResult,
    SimInjectXidRequest,
    SimResult,
)
from gpusched_cli.client import Client
from tests.conftest import DaemonHandle, wait_until
from tests.integration.test_daemon import submit, wait_done

WORK = ["sh", "-c", "sleep 4"]  # long enough to be running through the faults, short enough to finish


def job(request: Any) -> JobSpec:
    return JobSpec(argv=WORK, cwd="/tmp", env={"PATH": "/usr/bin:/bin"}, request=request)


def state(c: Client, job_id: int) -> JobState:
    return c.call(ShowRequest(job_id=job_id), ShowResult).job.state


def device_of(c: Client, job_id: int) -> str:
    allocation = c.call(ShowRequest(job_id=job_id), ShowResult).job.allocation
    assert allocation is not None
    return allocation.uuids[0]


@pytest.fixture
def node(daemon_factory: Any) -> DaemonHandle:
    return daemon_factory(sim="H100-80GB:3", gpus={
        "1": GpuConfig(mig=["3g.40gb", "3g.40gb"]),
        "2": GpuConfig(share="mps"),
    })


def test_faults_touch_only_the_jobs_on_the_affected_device(node: DaemonHandle) -> None:
    assert node.daemon is not None
    sim = simulator_of(node.daemon.engine.backend)
    assert sim is not None
    with node.client() as c:
        whole = submit(c, job(WholeRequest(gpus=1)))
        mig_hit, mig_safe = (submit(c, job(MigRequest(profile="3g.40gb"))) for _ in range(2))
        share_a, share_b = (submit(c, job(ShareRequest(fraction=0.5, gpu_mem_mib=4096))) for _ in range(2))
        everyone = [whole, mig_hit, mig_safe, share_a, share_b]
        wait_until(lambda: all(state(c, j) is JobState.RUNNING for j in everyone), what="all running")

        def still_running(*ids: int) -> None:
            for j in ids:
                assert state(c, j) is JobState.RUNNING, f"job {j} was touched: {state(c, j)}"

        # 1. An application XID on the whole GPU: recorded, nothing stops.
        c.call(SimInjectXidRequest(gpu=0, xid=43), SimResult)
        wait_until(lambda: c.call(ShowRequest(job_id=whole), ShowResult).events, what="app XID recorded")
        still_running(*everyone)

        # 2. A fatal XID scoped to one MIG instance: only its job fails.
        hit_uuid = device_of(c, mig_hit)
        gi = next(i.gi_id for i in c.call(GpusRequest(), GpusResult).gpus[1].instances if i.uuid == hit_uuid)
        c.call(SimInjectXidRequest(gpu=1, xid=94, gi=gi), SimResult)
        assert wait_done(c, mig_hit).job.reason.startswith("gpu_fault: XID 94")
        still_running(whole, mig_safe, share_a, share_b)

        # 3. A MIG create that the driver refuses: an error, nothing half-done, no job touched.
        sim.fail_next("nvmlDeviceCreateGpuInstanceWithPlacement", 23)  # NVML_ERROR_INSUFFICIENT_RESOURCES
        before = sorted((i.profile, i.start) for i in c.call(GpusRequest(), GpusResult).gpus[1].instances)
        with pytest.raises(ProtocolError) as err:  # replaces the drained (idle) 3g by a 2g and a 1g
            c.call(MigApplyRequest(gpu=1, layout=["3g.40gb", "2g.20gb", "1g.10gb"]), MigApplyResult)
        assert "rolled back: 0 new instance(s) removed, 1 destroyed instance(s) re-created" in err.value.message
        after = sorted((i.profile, i.start) for i in c.call(GpusRequest(), GpusResult).gpus[1].instances)
        assert after == before  # the old layout is back
        still_running(whole, mig_safe, share_a, share_b)

        # 4. The MPS control daemon of GPU 2 dies: running clients are left alone, and the next
        #    share on that GPU gets a fresh control daemon.
        pid_files = [os.path.join(root, f) for root, _, files in os.walk(os.path.join(node.state_dir, "mps"))
                     for f in files if f == "nvidia-cuda-mps-control.pid"]
        assert len(pid_files) == 1
        with open(pid_files[0]) as f:
            os.kill(int(f.read().strip()), signal.SIGKILL)
        still_running(whole, mig_safe, share_a, share_b)

        # 5. GPU 2 falls off the bus: its shares fail, everything else runs on.
        c.call(SimInjectXidRequest(gpu=2, xid=79, lost=True), SimResult)
        for j in (share_a, share_b):
            assert wait_done(c, j).job.reason.startswith("gpu_lost")
        still_running(whole, mig_safe)

        for j in (whole, mig_safe):
            res = wait_done(c, j, timeout=30)
            assert (res.job.state, res.job.exit_code) == (JobState.COMPLETED, 0)
