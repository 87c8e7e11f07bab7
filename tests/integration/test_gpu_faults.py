"""GPU faults and live configuration changes, from an audit (each test failed on the code before):
an unreadable GPU with a `[gpus.N]` table stopped the daemon from starting and every later reload;
a GPU lost while the daemon was down left its jobs running; a fixed MIG layout that a job kept back
was reported as reloaded and never applied; a simulated GPU switched into MIG mode under a job gave
its slices to others."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Callable
from typing import Any

from gpusched.config import ConfigError, DaemonConfig, GpuConfig
from gpusched.daemon import main as daemon_main
from gpusched.daemon.devices import simulator_of
from gpusched.gpu.nvml import open_backend
from gpusched.model import JobState
from gpusched.protocol import (
    CancelRequest,
    CancelResult,
    GpusRequest,
    GpusResult,
    ReloadRequest,
    ReloadResult,
    SimInjectXidRequest,
    SimResult,
)
from gpusched_cli.client import Client
from tests.conftest import DaemonHandle, DaemonProcess, kill_job_processes, short_tmpdir, wait_until
from tests.integration.test_daemon import spec, state_of, submit
from tests.integration.test_devices import mig_spec


def _holders(c: Client, gpu_index: int) -> set[int]:
    gpu = c.call(GpusRequest(), GpusResult).gpus[gpu_index]
    return set(gpu.jobs) | {j for i in gpu.instances for j in i.jobs}


def test_reload_adding_mig_to_a_busy_simulated_gpu_waits_until_it_is_idle(
        daemon_process: Callable[..., DaemonProcess]) -> None:
    """A reload adding `[gpus.1] mig = [...]` switched the busy simulated GPU into MIG mode under the
    whole-GPU job holding it, and the next MIG job started on a slice of that GPU."""
    proc = daemon_process().start()
    try:
        with Client(proc.socket) as c:
            whole = submit(c, spec("sleep", "60", gpus=2))
            wait_until(lambda: state_of(c, whole) is JobState.RUNNING, what="whole-GPU job running")
        proc.write_config('[gpus.1]\nmig = ["3g.40gb", "3g.40gb"]\n')
        with Client(proc.socket) as c:
            result = c.call(ReloadRequest(), ReloadResult)
            assert [line.split(":")[0] for line in result.not_applied] == ["gpus.1.mig"], result
            assert f"in use by job {whole}" in result.not_applied[0]
            assert not c.call(GpusRequest(), GpusResult).gpus[1].mig_enabled
            assert _holders(c, 1) == {whole}
            c.call(CancelRequest(job_ids=[whole]), CancelResult)
            wait_until(lambda: [i.profile for i in c.call(GpusRequest(), GpusResult).gpus[1].instances]
                       == ["3g.40gb", "3g.40gb"], timeout=15, what="the layout applied once GPU 1 is idle")
    finally:
        kill_job_processes(proc.state_dir)


def test_reload_of_a_fixed_layout_blocked_by_a_busy_instance_is_reported_and_applied_later(
        daemon_process: Callable[..., DaemonProcess]) -> None:
    """A busy instance blocked the new layout: the reload answered `reloaded: gpus`, the reason was
    only in the log, and the layout was never applied, not even after the job ended."""
    proc = daemon_process()
    proc.extra_config = '[gpus.1]\nmig = ["3g.40gb", "3g.40gb"]\n'
    proc.start()
    try:
        with Client(proc.socket) as c:
            job = submit(c, mig_spec("3g.40gb", "sleep", "60"))
            wait_until(lambda: state_of(c, job) is JobState.RUNNING, what="mig job running")
        proc.write_config('[gpus.1]\nmig = ["7g.80gb"]\n')
        with Client(proc.socket) as c:
            result = c.call(ReloadRequest(), ReloadResult)
            c.call(CancelRequest(job_ids=[job]), CancelResult)
            wait_until(lambda: state_of(c, job) is JobState.CANCELLED, what="cancelled")

            def profiles() -> list[str]:
                return [i.profile for i in c.call(GpusRequest(), GpusResult).gpus[1].instances]
            assert [line.split(":")[0] for line in result.not_applied] == ["gpus.1.mig"], result
            wait_until(lambda: profiles() == ["7g.80gb"], timeout=15, what="the new layout applied once GPU 1 is idle")
    finally:
        kill_job_processes(proc.state_dir)


def test_reload_after_a_gpu_is_lost_still_applies_an_unrelated_change(
        daemon_process: Callable[..., DaemonProcess]) -> None:
    """A lost GPU with a `[gpus.N]` table made every later reload fail ('there is no GPU 1'), even one
    that only changed a weight: nothing could be changed until a restart."""
    proc = daemon_process()
    proc.extra_config = '[gpus.1]\nshare = "mps"\n'
    proc.start()
    with Client(proc.socket) as c:
        c.call(SimInjectXidRequest(gpu=1, xid=79, lost=True), SimResult)
        wait_until(lambda: len(c.call(GpusRequest(), GpusResult).gpus) == 1, what="GPU 1 gone")
    proc.write_config('[gpus.1]\nshare = "mps"\n[fairness.weights]\nroot = 300\n')
    with Client(proc.socket) as c:
        result = c.call(ReloadRequest(), ReloadResult)  # ProtocolError: gpus.1: there is no GPU 1
        assert result.changed == ["fairness"]


def test_start_with_a_configured_gpu_that_is_unreadable_still_serves_the_others() -> None:
    """An unreadable GPU is unschedulable (doctor: `gpuN.readable` FAIL), but with a `[gpus.N]` table
    for it the daemon refused to start at all."""
    base = short_tmpdir()
    config = DaemonConfig(socket=os.path.join(base, "g.sock"), state_dir=os.path.join(base, "state"),
                          sim="H100-80GB:2", cgroup_root="off", gpus={"1": GpuConfig(share="mps")})
    backend = open_backend("H100-80GB:2")
    sim = simulator_of(backend)
    assert sim is not None
    sim.lose_gpu(1)

    async def main() -> None:
        daemon = await daemon_main.start(config, backend=backend, backend_name="sim")
        await daemon_main.stop(daemon)

    try:
        asyncio.run(main())  # ConfigError: gpus.1: there is no GPU 1 (this node has GPUs 0-0)
    except ConfigError as exc:
        raise AssertionError(f"daemon refused to start because one GPU is unreadable: {exc}") from None
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_gpu_lost_while_the_daemon_was_down_stops_its_jobs(daemon_factory: Callable[..., DaemonHandle]) -> None:
    """A lost GPU's jobs end `gpu_lost`. One that fell off the bus while gpuschedd was down (upgrade,
    crash) was keyed `gpu-index:N` (no inventory had shown it) and jobs were matched by UUID only:
    the restarted daemon left the job on it running, for ever."""
    handle = daemon_factory()
    with handle.client() as c:
        job = submit(c, spec("sleep", "60", gpus=2))
        wait_until(lambda: state_of(c, job) is JobState.RUNNING, what="running")
    handle.stop()
    backend = open_backend(handle.sim)
    sim = simulator_of(backend)
    assert sim is not None
    sim.lose_gpu(1)
    config = DaemonConfig(socket=handle.socket, state_dir=handle.state_dir, sim=handle.sim, **handle.overrides)
    ready: dict[str, Any] = {}

    async def main() -> None:
        daemon = await daemon_main.start(config, backend=backend, backend_name="sim")
        try:
            for _ in range(200):  # the lost GPU's event reaches the engine from the device watcher
                if daemon.engine.get(job).state is not JobState.RUNNING:
                    break
                await asyncio.sleep(0.05)
            ready["job"] = daemon.engine.get(job)
            ready["drained"] = dict(daemon.engine.devices.health.drained())
            # drained under its index (no inventory showed its UUID): `gpus resume 1` must reach it
            ready["resumed"] = daemon.engine.resume_device("1", "root")
        finally:
            await daemon_main.stop(daemon)

    asyncio.run(main())
    got = ready["job"]
    # The lost event does arrive, but decide() keys it `gpu-index:1` (GPU 1 is not in the inventory),
    # and _on_gpu_event matches jobs by UUID only: the job on GPU 1 is never stopped.
    assert got.state is not JobState.RUNNING, (
        f"job {job} still {got.state.value} on lost GPU 1; drains: {sorted(ready['drained'])}")
    assert "gpu-index:1" in ready["drained"] and ready["resumed"] == ["gpu-index:1"], ready
