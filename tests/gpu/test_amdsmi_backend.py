"""Contract tests of AmdSmiBackend against the simulated amdsmi (the same code path as the real
library), plus one test against the real amdsmi that skips, naming why, where it cannot load."""

from __future__ import annotations

import pytest

from gpusched.gpu.amd_profiles import AMD_MODELS
from gpusched.gpu.amdsmi import AmdSmiBackend, logical_uuid, open_amd_backend
from gpusched.gpu.backend import (
    GpuBackend,
    GpuBusyError,
    GpuError,
    GpuInvalidArgumentError,
    GpuNotFoundError,
    GpuNotSupportedError,
    GpuPermissionError,
)
from gpusched.gpu.simamdsmi import MiB, SimAmdSmi
from gpusched.gpu.simamdsmi_api import AMDSMI_STATUS_BUSY, AMDSMI_STATUS_NO_PERM, AMDSMI_STATUS_NOT_FOUND


def _backend(spec: str = "MI300X:2") -> tuple[AmdSmiBackend, SimAmdSmi]:
    b = open_amd_backend(spec)
    _: GpuBackend = b
    return b, b.module


@pytest.mark.parametrize(("compute", "memory"), AMD_MODELS["MI300X"].valid_combinations())
def test_inventory_per_mode(compute: str, memory: str) -> None:
    b, _sim = _backend()
    b.set_partition_mode(0, compute, memory)
    inv = b.inventory()
    model = AMD_MODELS["MI300X"]
    n = model.partitions(compute)
    assert len(inv.gpus) == n + 1 and not inv.errors
    logical = inv.gpus[:n]
    assert [g.index for g in inv.gpus] == list(range(n + 1))
    assert {g.partition.physical_index for g in logical if g.partition} == {0}
    assert [g.partition.index_in_physical for g in logical if g.partition] == list(range(n))
    assert all(g.vendor == "amd" and g.model == "MI300X" and not g.mig_enabled for g in inv.gpus)
    assert all(g.sm_count == 304 // n and g.memory_total_mib == 192 * 1024 // n for g in logical)
    assert len({g.uuid for g in inv.gpus}) == n + 1
    assert inv.gpus[n].partition is not None and inv.gpus[n].partition.compute_mode == "SPX"
    assert inv.gpus[n].partition.physical_index == 1


def test_mode_change_makes_logical_gpus_appear_and_disappear_with_new_ids() -> None:
    b, _ = _backend("MI300X:1")
    (whole,) = b.inventory().gpus
    assert b.set_partition_mode(0, "QPX", "NPS1").detail == "4 logical GPU(s)"
    quads = b.inventory().gpus
    assert [g.uuid for g in quads] == [logical_uuid(whole.uuid, "QPX", "NPS1", i, 4) for i in range(4)]
    assert b.inventory().gpus == quads  # stable while the mode stays
    b.set_partition_mode(0, "CPX", "NPS4")
    eights = b.inventory().gpus
    assert len(eights) == 8 and not {g.uuid for g in eights} & {g.uuid for g in quads}
    b.set_partition_mode(0, "SPX", "NPS1")  # needs the memory mode first: SPX is refused under NPS4
    assert b.inventory().gpus == (whole,)


def test_processes_per_logical_gpu_and_busy_refusal() -> None:
    b, sim = _backend()
    b.set_partition_mode(0, "CPX", "NPS1")
    gpus = b.inventory().gpus
    sim.add_process(0, 5, pid=4242, vram_bytes=3 * MiB)
    assert [(p.pid, p.used_memory_bytes) for p in b.processes(gpus[5].uuid)] == [(4242, 3 * MiB)]
    assert b.processes(gpus[4].uuid) == []
    with pytest.raises(GpuBusyError, match="logical GPU"):
        b.set_partition_mode(0, "SPX", "NPS1")
    b.set_partition_mode(1, "DPX", "NPS1")  # another physical GPU, compute only: allowed
    with pytest.raises(GpuBusyError, match="reloads amdgpu"):
        b.set_partition_mode(1, "CPX", "NPS4")  # a memory change needs the whole node idle
    assert sim.mode(0) == ("CPX", "NPS1") and sim.mode(1) == ("DPX", "NPS1")


def test_invalid_combination_names_the_valid_ones() -> None:
    b, sim = _backend()
    with pytest.raises(GpuInvalidArgumentError) as exc:
        b.set_partition_mode(0, "SPX", "NPS4")
    assert "CPX/NPS4" in exc.value.hint and "SPX/NPS1" in exc.value.hint
    with pytest.raises(GpuInvalidArgumentError):
        b.set_partition_mode(0, "TPX", "NPS1")  # MI300A's mode
    with pytest.raises(GpuNotFoundError):
        b.set_partition_mode(7, "SPX", "NPS1")
    assert sim.mode(0) == ("SPX", "NPS1")


def test_library_statuses_map_to_typed_errors() -> None:
    b, sim = _backend()
    sim.set_privileged(False)
    with pytest.raises(GpuPermissionError):
        b.set_partition_mode(0, "CPX", "NPS1")
    sim.set_privileged(True)
    sim.fail_next("amdsmi_set_gpu_compute_partition", AMDSMI_STATUS_BUSY)  # e.g. a process the list missed
    with pytest.raises(GpuBusyError):
        b.set_partition_mode(0, "CPX", "NPS1")
    sim.fail_next("amdsmi_get_gpu_process_list", AMDSMI_STATUS_NOT_FOUND)
    with pytest.raises(GpuNotFoundError):
        b.processes(b.inventory().gpus[0].uuid)
    sim.fail_next("amdsmi_get_gpu_asic_info", AMDSMI_STATUS_NO_PERM)
    inv = b.inventory()
    assert list(inv.errors) == [0] and [g.index for g in inv.gpus] == [1]
    for call in (lambda: b.create_instance(0, "1g.10gb", 0), lambda: b.destroy_instance("x"),
                 lambda: b.set_mig_mode(0, True)):
        with pytest.raises(GpuNotSupportedError):
            call()


def test_events_map_to_xid_policy_and_lost_gpus_are_reported_once() -> None:
    b, sim = _backend()
    b.set_partition_mode(1, "DPX", "NPS1")
    b.inventory()
    assert b.wait_event(10) is None
    sim.inject_event(1, 1, "VMFAULT")
    ev = b.wait_event(100)
    assert ev is not None and (ev.gpu_index, ev.xid, ev.lost) == (2, 31, False)
    sim.inject_event(0, 0, "THERMAL_THROTTLE")
    sim.inject_event(0, 0, "RING_HANG")
    ev = b.wait_event(100)
    assert ev is not None and (ev.gpu_index, ev.xid) == (0, 8)
    sim.lose_gpu(1)
    lost = [b.wait_event(10), b.wait_event(10)]
    assert sorted((e.gpu_index, e.xid, e.lost) for e in lost if e) == [(1, 79, True), (2, 79, True)]
    assert b.wait_event(10) is None
    inv = b.inventory()
    assert sorted(inv.errors) == [1, 2] and [g.index for g in inv.gpus] == [0]
    assert "UNEXPECTED_SIZE" in inv.errors[1]
    b.close()
    assert b.wait_event(10) is None


def test_bad_sim_spec_is_a_typed_error() -> None:
    with pytest.raises(GpuInvalidArgumentError):
        open_amd_backend("MI999X:1")


def test_nvml_backend_refuses_partition_modes() -> None:
    from gpusched.gpu.nvml import open_backend

    with pytest.raises(GpuNotSupportedError):
        open_backend("H100-80GB:1").set_partition_mode(0, "CPX", "NPS4")


def test_real_amdsmi_inventory() -> None:
    """Against the real library: skipped, naming why, without the package, its .so or a driver."""
    try:
        b = open_amd_backend(None)
    except GpuError as err:
        pytest.skip(f"real amdsmi unavailable here: {err.message}")
    try:
        inv = b.inventory()
        assert all(g.vendor == "amd" for g in inv.gpus)
        assert all(g.partition is None or 0 <= g.partition.index_in_physical < g.partition.count for g in inv.gpus)
    finally:
        b.close()


def test_simulator_names_and_codes_match_the_real_package() -> None:
    """The simulator's status codes and enum values against the installed amdsmi, where it loads."""
    try:
        import amdsmi  # type: ignore[import-not-found]
    except (ImportError, OSError) as err:
        pytest.skip(f"real amdsmi not importable here: {err}")
    from gpusched.gpu import simamdsmi_api as api

    for code, name in api.STATUS_NAMES.items():
        assert getattr(amdsmi.amdsmi_wrapper, name) == code, name
    for enum in ("AmdSmiComputePartitionType", "AmdSmiMemoryPartitionType", "AmdSmiMemoryType",
                 "AmdSmiEvtNotificationType", "AmdSmiInitFlags"):
        assert {m.name: int(m) for m in getattr(amdsmi, enum)} == {m.name: int(m) for m in getattr(api, enum)}
