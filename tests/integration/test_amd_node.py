"""An AMD Instinct node end to end: the real daemon on simulated MI300X (`--sim MI300X:2`), the real
client. Logical GPUs are whole GPUs to the scheduler; jobs see ROCm's variables, never CUDA's."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import pytest

from gpusched.model import JobSpec, JobState, MigRequest, ShareRequest
from gpusched.protocol import (
    DoctorRequest,
    DoctorResult,
    ErrorCode,
    GpusRequest,
    GpusResult,
    LogsRequest,
    LogsResult,
    ProtocolError,
    QueueRequest,
    QueueResult,
)
from gpusched_cli.client import Client
from tests.conftest import DaemonHandle, DaemonProcess
from tests.integration.test_daemon import spec, submit, wait_done

ENV_DUMP = "env | grep -E '^(ROCR|HIP|CUDA)_VISIBLE_DEVICES=|^GPU_DEVICE_ORDINAL=' | sort"


def _visible(c: Client, job_id: int) -> dict[str, str]:
    res = wait_done(c, job_id)
    assert res.job.state is JobState.COMPLETED, res.job.reason
    out = c.call(LogsRequest(job_id=job_id), LogsResult).data
    return dict(line.split("=", 1) for line in out.splitlines() if line)


@pytest.fixture
def amd(daemon_factory: Callable[..., DaemonHandle]) -> DaemonHandle:
    """A daemon on two simulated MI300X in their boot mode (SPX/NPS1: one logical GPU each)."""
    return daemon_factory("MI300X:2")


def test_whole_gpu_jobs_run_on_logical_gpus_and_see_rocm_variables(amd: DaemonHandle) -> None:
    with amd.client() as c:
        gpus = c.call(GpusRequest(), GpusResult)
        stale = spec("sh", "-c", ENV_DUMP).model_copy(update={"env": {
            "PATH": os.environ["PATH"], "CUDA_VISIBLE_DEVICES": "GPU-stale", "HIP_VISIBLE_DEVICES": "7"}})
        one = submit(c, stale)
        seen = _visible(c, one)
        # One logical GPU: ROCr is given its index, HIP numbers what ROCr left visible. The
        # submitter's own CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES do not reach the job.
        assert set(seen) == {"ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"}, seen
        assert seen["ROCR_VISIBLE_DEVICES"] in {str(g.index) for g in gpus.gpus}
        assert seen["HIP_VISIBLE_DEVICES"] == "0"
        two = submit(c, spec("sh", "-c", ENV_DUMP, gpus=2))
        seen = _visible(c, two)
        assert sorted(seen["ROCR_VISIBLE_DEVICES"].split(",")) == ["0", "1"], seen
        assert seen["HIP_VISIBLE_DEVICES"] == "0,1"
        assert "CUDA_VISIBLE_DEVICES" not in seen


def test_gpus_lists_logical_gpus_with_their_partition(amd: DaemonHandle) -> None:
    with amd.client() as c:
        res = c.call(GpusRequest(), GpusResult)
    assert res.backend == "sim-amdsmi"
    assert [g.index for g in res.gpus] == [0, 1]
    for g in res.gpus:
        assert g.vendor == "amd" and g.model == "MI300X" and not g.mig_enabled
        assert g.sm_count == 304 and g.memory_total_mib == 192 * 1024
        assert g.partition is not None
        assert (g.partition.compute_mode, g.partition.memory_mode, g.partition.count) == ("SPX", "NPS1", 1)
        assert g.partition.physical_index == g.index
    assert res.gpus[0].partition.physical_uuid != res.gpus[1].partition.physical_uuid  # type: ignore[union-attr]


def test_mig_and_share_requests_are_refused_with_the_reason(amd: DaemonHandle) -> None:
    with amd.client() as c:
        with pytest.raises(ProtocolError) as err:
            submit(c, spec("true").model_copy(update={"request": MigRequest(profile="3g.40gb")}))
        assert err.value.code is ErrorCode.UNSATISFIABLE
        assert "AMD Instinct (MI300X)" in err.value.message and "no MIG" in err.value.message
        with pytest.raises(ProtocolError) as err:
            submit(c, spec("true").model_copy(update={"request": ShareRequest(fraction=0.5, gpu_mem_mib=1024)}))
        assert err.value.code is ErrorCode.UNSATISFIABLE
        assert "timeslice" in err.value.message and "no MPS on AMD" in err.value.message
        assert c.call(QueueRequest(all=True), QueueResult).jobs == []


def test_timeslice_shares_run_on_an_amd_gpu_configured_for_them(
        daemon_factory: Callable[..., DaemonHandle]) -> None:
    from gpusched.config_sections import GpuConfig

    d = daemon_factory("MI300X:1", gpus={"0": GpuConfig(share="timeslice")})
    with d.client() as c:
        s = JobSpec(argv=["sh", "-c", ENV_DUMP], cwd=os.getcwd(), env={"PATH": os.environ["PATH"]},
                    request=ShareRequest(fraction=0.5, gpu_mem_mib=1024))
        job_id = submit(c, s)
        seen = _visible(c, job_id)
        assert seen == {"ROCR_VISIBLE_DEVICES": "0", "HIP_VISIBLE_DEVICES": "0"}


def test_doctor_reports_partitions_and_no_mig(amd: DaemonHandle) -> None:
    with amd.client() as c:
        checks = {ch.name: ch for ch in c.call(DoctorRequest(), DoctorResult).checks}
    assert checks["amdsmi"].status == "PASS" and "2 GPU(s)" in checks["amdsmi"].detail
    assert "SPX/NPS1" in checks["gpu0.partition"].detail and "304 CUs" in checks["gpu0.partition"].detail
    assert not any(name.endswith(".mig") for name in checks)
    assert checks["numa"].status == "PASS", checks["numa"]  # each GPU's NUMA node's CPUs (gpu/numa.py)


def test_whole_gpu_job_request_waits_for_a_free_logical_gpu(amd: DaemonHandle) -> None:
    """Two logical GPUs, three one-GPU jobs: the third runs after one ends (no GPU is given twice)."""
    with amd.client() as c:
        ids = [submit(c, spec("sh", "-c", "echo $ROCR_VISIBLE_DEVICES")) for _ in range(3)]
        logs = [_visible_line(c, i) for i in ids]
    assert set(logs) <= {"0", "1"}


def _visible_line(c: Client, job_id: int) -> str:
    res = wait_done(c, job_id)
    assert res.job.state is JobState.COMPLETED, res.job.reason
    return c.call(LogsRequest(job_id=job_id), LogsResult).data.strip()


def test_cli_shows_amd_gpus(amd: DaemonHandle) -> None:
    out = subprocess.run([sys.executable, "-m", "gpusched_cli.main", "--socket", amd.socket, "gpus"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "backend sim-amdsmi" in out.stdout
    assert "partition 0 of 1 on physical GPU 1, SPX/NPS1" in out.stdout
    assert "304 CUs, no MIG (AMD)" in out.stdout


def _run_daemon(tmp: str, sim: str, config: str) -> subprocess.CompletedProcess[str]:
    """The real gpuschedd with a config and a --sim spec it must refuse (it exits; nothing waits)."""
    path = os.path.join(tmp, "gpusched.toml")
    with open(path, "w") as f:
        f.write('cgroup_root = "off"\n' + config)
    return subprocess.run(
        [sys.executable, "-m", "gpusched.daemon.main", "--config", path, "--sim", sim,
         "--socket", os.path.join(tmp, "g.sock"), "--state-dir", os.path.join(tmp, "state")],
        capture_output=True, text=True, timeout=60,
    )


@pytest.mark.parametrize("config, field, words", [
    ('[gpus.0]\nshare = "mps"\n', "gpus.0.share", "MPS is NVIDIA only"),
    ('[gpus.1]\nmig = "dynamic"\n', "gpus.1.mig", "AMD GPUs have no MIG"),
    ('[gpus.0]\nmig = ["3g.40gb"]\n', "gpus.0.mig", "AMD GPUs have no MIG"),
])
def test_amd_config_errors_name_the_field(tmp_path: object, config: str, field: str, words: str) -> None:
    out = _run_daemon(str(tmp_path), "MI300X:2", config)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert field in out.stderr and words in out.stderr and "MI300X logical GPU (SPX/NPS1" in out.stderr


def test_mixed_vendors_in_sim_are_refused(tmp_path: object) -> None:
    out = _run_daemon(str(tmp_path), "H100-80GB:1,MI300X:1", "")
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    assert "mixes NVIDIA (H100-80GB) and AMD (MI300X) models" in out.stderr, out.stderr
    assert not os.path.exists(os.path.join(str(tmp_path), "g.sock"))


def test_cpx_logical_gpus_are_scheduled_one_by_one(daemon_factory: Callable[..., DaemonHandle]) -> None:
    """`--sim MI300X:1@CPX`: one physical GPU as 8 logical GPUs of 38 CUs and 24 GiB; a 2-GPU job gets
    two of them, named to ROCr by their indices, which are the GPUs its allocation holds."""
    d = daemon_factory("MI300X:1@CPX")
    with d.client() as c:
        gpus = c.call(GpusRequest(), GpusResult).gpus
        assert [(g.partition.index_in_physical, g.partition.count, g.partition.compute_mode)  # type: ignore[union-attr]
                for g in gpus] == [(i, 8, "CPX") for i in range(8)]
        assert {(g.sm_count, g.memory_total_mib) for g in gpus} == {(38, 24 * 1024)}
        assert len({g.uuid for g in gpus}) == 8  # one id per logical GPU, though amdsmi's UUID is shared
        job_id = submit(c, spec("sh", "-c", ENV_DUMP, gpus=2))
        seen = _visible(c, job_id)
        job = wait_done(c, job_id).job
        assert job.allocation is not None
        by_uuid = {g.uuid: g.index for g in gpus}
        held = [by_uuid[u] for u in job.allocation.uuids]
        assert seen["ROCR_VISIBLE_DEVICES"] == ",".join(map(str, held)) and len(held) == 2
        assert seen["HIP_VISIBLE_DEVICES"] == "0,1"
        with pytest.raises(ProtocolError) as err:
            submit(c, spec("true", gpus=9))
        assert err.value.code is ErrorCode.UNSATISFIABLE


def test_a_start_mode_the_gpu_does_not_run_is_refused(tmp_path: object) -> None:
    out = _run_daemon(str(tmp_path), "MI300X:1@DPX/NPS4", "")
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "MI300X does not run DPX/NPS4" in out.stderr and "QPX/NPS4" in out.stderr


def test_reload_refuses_mps_on_an_amd_gpu_and_keeps_the_old_config(
        daemon_process: Callable[..., DaemonProcess]) -> None:
    proc = daemon_process("MI300X:2").start()
    proc.write_config('[gpus.1]\nshare = "timeslice"\n')
    done = _gs(proc, "admin", "reload")
    assert done.returncode == 0, done.stderr
    proc.write_config('[gpus.1]\nshare = "mps"\n')
    done = _gs(proc, "admin", "reload")
    assert done.returncode != 0
    assert "configuration not reloaded" in done.stderr and "gpus.1.share" in done.stderr
    assert "MPS is NVIDIA only" in done.stderr
    shown = _gs(proc, "gpus")
    assert shown.stdout.count("share timeslice") == 1, shown.stdout  # GPU 1 kept the reloaded mode


def _gs(proc: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpusched_cli.main", "--socket", proc.socket, *args],
                          capture_output=True, text=True, timeout=60)


def test_partition_jobs_change_an_idle_gpu_mode_from_demand_and_never_a_busy_one(
        daemon_factory: Callable[..., DaemonHandle]) -> None:
    """`--partition cpx` on two SPX MI300X: one GPU runs a whole-GPU job, so the other (idle) one
    changes to CPX and the CPX jobs run on its logical GPUs; the busy one keeps SPX."""
    from gpusched.config_sections import MigSection
    from gpusched.model import Job, PartitionRequest
    from gpusched.protocol import ShowRequest, ShowResult
    from tests.conftest import wait_until

    d = daemon_factory("MI300X:2", mig=MigSection(min_idle_s=0, min_reconfig_interval_s=0))
    with d.client() as c:
        busy = submit(c, spec("sleep", "30"))
        def show(job_id: int) -> Job:
            return c.call(ShowRequest(job_id=job_id), ShowResult).job

        wait_until(lambda: show(busy).state is JobState.RUNNING, timeout=20, what="the whole-GPU job running")
        held = show(busy).allocation
        assert held is not None
        busy_physical = held.devices[0].gpu_index  # SPX: logical index == physical index
        # best fit takes the lowest index among equals; on GPU 1 it would pin GPU 0 too (a change of
        # GPU 0 renumbers GPU 1's logical GPU under the running job), which the core tests cover
        assert busy_physical == 0, held
        cpx = JobSpec(argv=["sh", "-c", ENV_DUMP], cwd=os.getcwd(), env={"PATH": os.environ["PATH"]},
                      request=PartitionRequest(mode="CPX"))
        ids = [submit(c, cpx) for _ in range(3)]
        seen = [_visible(c, i) for i in ids]

        def modes() -> dict[int, set[str]]:
            out: dict[int, set[str]] = {}
            for g in c.call(GpusRequest(), GpusResult).gpus:
                assert g.partition is not None
                out.setdefault(g.partition.physical_index, set()).add(g.partition.compute_mode)
            return out

        now = modes()
        assert now[busy_physical] == {"SPX"}  # the busy GPU was never changed
        assert now[1 - busy_physical] == {"CPX"}
        cpx_indices = {str(g.index) for g in c.call(GpusRequest(), GpusResult).gpus
                       if g.partition is not None and g.partition.compute_mode == "CPX"}
        assert len(cpx_indices) == 8
        for s in seen:
            assert s["ROCR_VISIBLE_DEVICES"] in cpx_indices and s["HIP_VISIBLE_DEVICES"] == "0", s
        assert show(busy).state is JobState.RUNNING  # untouched by the change
        assert show(busy).allocation == held
    out = subprocess.run([sys.executable, "-m", "gpusched_cli.main", "--socket", d.socket, "gpus"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "CPX/NPS1" in out.stdout and "SPX/NPS1" in out.stdout
