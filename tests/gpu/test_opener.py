"""Which backend a node gets (gpu/opener.py), what an AMD job's environment holds (daemon/launch.py),
and why the core refuses MIG and MPS-less shares on AMD logical GPUs (core/satisfiable.py)."""

from __future__ import annotations

import dataclasses
import os

import pytest

from gpusched.config import DaemonConfig
from gpusched.core.satisfiable import unsatisfiable_reason
from gpusched.daemon import launch
from gpusched.gpu import amdsmi, nvml
from gpusched.gpu.backend import GpuError, GpuInvalidArgumentError
from gpusched.gpu.opener import open_gpu, vendor_of_spec
from gpusched.model import AllocatedDevice, Allocation, Job, JobSpec, JobState, MigRequest, ShareRequest, WholeRequest


@pytest.mark.parametrize("spec, vendor", [
    ("H100-80GB:2", "nvidia"), ("A100-40GB:2,H200:2", "nvidia"), ("MI300X:2", "amd"),
    ("MI300X:1,MI325X:1", "amd"), ("MI300X:1@CPX", "amd"),
])
def test_the_spec_names_its_vendor(spec: str, vendor: str) -> None:
    assert vendor_of_spec(spec) == vendor


@pytest.mark.parametrize("spec, words", [
    ("H100-80GB:1,MI300X:2", "mixes NVIDIA (H100-80GB) and AMD (MI300X) models"),
    ("MI400X:1", "unknown GPU model 'MI400X'"),
])
def test_a_bad_spec_is_refused_before_anything_opens(spec: str, words: str) -> None:
    with pytest.raises(GpuInvalidArgumentError, match=words.replace("(", r"\(").replace(")", r"\)")):
        open_gpu(spec)


def test_simulators_get_their_vendors_backend_and_name() -> None:
    for spec, name, cls in (("H100-80GB:1", "sim", nvml.NvmlBackend), ("MI325X:1", "sim-amdsmi", amdsmi.AmdSmiBackend)):
        backend, shown = open_gpu(spec)
        assert shown == name and isinstance(backend, cls)
        backend.close()


def test_real_hardware_tries_nvml_then_amdsmi_and_names_both_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_nvml(spec: str | None) -> nvml.NvmlBackend:
        raise GpuError("cannot load NVML: LibraryNotFound")

    monkeypatch.setattr(nvml, "open_backend", no_nvml)
    sim = amdsmi.open_amd_backend("MI300X:1")
    monkeypatch.setattr(amdsmi, "open_amd_backend", lambda spec: sim if spec is None else None)
    backend, name = open_gpu(None)
    assert backend is sim and name == "amdsmi"

    def no_amd(spec: str | None) -> amdsmi.AmdSmiBackend:
        raise GpuError("cannot load amdsmi: No module named 'amdsmi'")

    monkeypatch.setattr(amdsmi, "open_amd_backend", no_amd)
    with pytest.raises(GpuError) as err:
        open_gpu(None)
    assert "NVIDIA: cannot load NVML: LibraryNotFound" in err.value.message
    assert "AMD: cannot load amdsmi" in err.value.message
    assert "--sim H100-80GB:2" in err.value.hint and "--sim MI300X:2" in err.value.hint


def _job(env: dict[str, str]) -> Job:
    spec = JobSpec(argv=["true"], cwd="/", env=env, request=WholeRequest(gpus=2))
    return Job(id=7, uid=os.getuid(), gid=os.getgid(), user="alice", spec=spec, state=JobState.PENDING,
               submitted_at=0.0)


def test_amd_jobs_get_rocm_variables_and_no_cuda_ones() -> None:
    amd_backend = amdsmi.open_amd_backend("MI300X:1@CPX")
    gpus = amd_backend.inventory().gpus
    alloc = Allocation(devices=[AllocatedDevice(uuid=gpus[i].uuid, gpu_index=i, kind="gpu") for i in (5, 2)],
                       compute_fraction=2.0, env={"NVIDIA_TF32_OVERRIDE": "0"})
    config = DaemonConfig(socket="/tmp/s", state_dir="/tmp/d", cuda_device_max_connections=8)
    added = launch.allocation_env(_job({}), alloc, config, gpus)
    assert added["ROCR_VISIBLE_DEVICES"] == "5,2" and added["HIP_VISIBLE_DEVICES"] == "0,1"
    assert not any(k.startswith(("CUDA_", "NVIDIA_")) for k in added), added
    env = launch.job_env(_job({"CUDA_VISIBLE_DEVICES": "GPU-x", "ROCR_VISIBLE_DEVICES": "0,1,2",
                               "GPU_DEVICE_ORDINAL": "3", "KEEP": "1"}), added)
    assert env["ROCR_VISIBLE_DEVICES"] == "5,2" and env["KEEP"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in env and "GPU_DEVICE_ORDINAL" not in env
    nvidia = nvml.open_backend("H100-80GB:1").inventory().gpus
    alloc = Allocation(devices=[AllocatedDevice(uuid=nvidia[0].uuid, gpu_index=0, kind="gpu")], compute_fraction=1.0)
    added = launch.allocation_env(_job({}), alloc, config, nvidia)
    assert added["CUDA_VISIBLE_DEVICES"] == nvidia[0].uuid and added["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"
    assert "ROCR_VISIBLE_DEVICES" not in added


def test_the_core_says_why_mig_and_unshared_shares_never_run_on_amd() -> None:
    gpus = amdsmi.open_amd_backend("MI300X:1@QPX").inventory().gpus
    assert unsatisfiable_reason(WholeRequest(gpus=4), gpus) is None
    assert "has 4 GPU(s) with MIG off" in (unsatisfiable_reason(WholeRequest(gpus=5), gpus) or "")
    why = unsatisfiable_reason(MigRequest(profile="1g.10gb"), gpus) or ""
    assert "AMD Instinct (MI300X) logical GPUs, which have no MIG" in why
    share = ShareRequest(fraction=0.5, gpu_mem_mib=1024)
    assert "no MPS on AMD" in (unsatisfiable_reason(share, gpus) or "")
    assert unsatisfiable_reason(share, gpus, {gpus[0].uuid: "timeslice"}) is None
    big = ShareRequest(fraction=0.5, gpu_mem_mib=60 * 1024)  # a QPX logical GPU has 48 GiB
    assert "largest shared device on this node has 49152 MiB" in (
        unsatisfiable_reason(big, gpus, {gpus[0].uuid: "timeslice"}) or "")


def test_nvml_with_no_gpu_gives_way_to_amdsmi_and_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    """An AMD node with NVIDIA's library installed: NVML opens but lists no GPU, so amdsmi is used."""
    empty = nvml.open_backend("H100-80GB:1")
    no_gpus = dataclasses.replace(empty.inventory(), gpus=())
    monkeypatch.setattr(empty, "inventory", lambda: no_gpus)
    closed: list[str] = []
    monkeypatch.setattr(empty, "close", lambda: closed.append("nvml"))
    monkeypatch.setattr(nvml, "open_backend", lambda spec: empty)
    amd = amdsmi.open_amd_backend("MI300X:1")
    monkeypatch.setattr(amdsmi, "open_amd_backend", lambda spec: amd)
    backend, name = open_gpu(None)
    assert backend is amd and name == "amdsmi" and closed == ["nvml"]


def test_nvml_with_no_gpu_is_kept_when_amdsmi_cannot_load_or_sees_none(monkeypatch: pytest.MonkeyPatch) -> None:
    full = nvml.open_backend("H100-80GB:1")
    empty_inventory = dataclasses.replace(full.inventory(), gpus=())
    monkeypatch.setattr(full, "inventory", lambda: empty_inventory)
    amd = amdsmi.open_amd_backend("MI300X:1")
    no_amd_gpus = dataclasses.replace(amd.inventory(), gpus=())
    monkeypatch.setattr(amd, "inventory", lambda: no_amd_gpus)
    monkeypatch.setattr(nvml, "open_backend", lambda spec: full)

    def no_amd(spec: str | None) -> amdsmi.AmdSmiBackend:
        raise GpuError("cannot load amdsmi: No module named 'amdsmi'")

    monkeypatch.setattr(amdsmi, "open_amd_backend", no_amd)
    assert open_gpu(None) == (full, "nvml")
    monkeypatch.setattr(amdsmi, "open_amd_backend", lambda spec: amd)
    assert open_gpu(None) == (full, "nvml")


def test_nvml_with_gpus_never_asks_amdsmi(monkeypatch: pytest.MonkeyPatch) -> None:
    full = nvml.open_backend("H100-80GB:1")
    monkeypatch.setattr(nvml, "open_backend", lambda spec: full)

    def must_not_open(spec: str | None) -> amdsmi.AmdSmiBackend:
        raise AssertionError("amdsmi opened on an NVIDIA node")

    monkeypatch.setattr(amdsmi, "open_amd_backend", must_not_open)
    assert open_gpu(None) == (full, "nvml")
