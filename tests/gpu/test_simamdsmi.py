"""Contract tests of the simulated amdsmi: the library's names, status codes and partition rules,
and a property test of its invariants (logical GPUs add up to the physical GPU in every valid mode;
no mode change while busy)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpusched.gpu.amd_profiles import AMD_MODELS
from gpusched.gpu.simamdsmi import MiB, SimAmdSmi
from gpusched.gpu.simamdsmi_api import (
    AMDSMI_STATUS_AMDGPU_RESTART_ERR,
    AMDSMI_STATUS_BUSY,
    AMDSMI_STATUS_NO_DATA,
    AMDSMI_STATUS_NO_PERM,
    AMDSMI_STATUS_NOT_FOUND,
    AMDSMI_STATUS_NOT_INIT,
    AMDSMI_STATUS_NOT_SUPPORTED,
    AMDSMI_STATUS_SETTING_UNAVAILABLE,
    AmdSmiLibraryException,
)
from gpusched.gpu.simamdsmi_state import amdsmi_uuid

C = SimAmdSmi.AmdSmiComputePartitionType
M = SimAmdSmi.AmdSmiMemoryPartitionType


def _sim(spec: str = "MI300X:1") -> SimAmdSmi:
    s: SimAmdSmi = SimAmdSmi.from_spec(spec, seed=7)
    s.amdsmi_init()
    return s


def _code(exc: pytest.ExceptionInfo[AmdSmiLibraryException]) -> int:
    return int(exc.value.get_error_code())


def test_calls_before_init_fail_not_init() -> None:
    s: SimAmdSmi = SimAmdSmi.from_spec("MI300X:1")
    with pytest.raises(AmdSmiLibraryException) as exc:
        s.amdsmi_get_processor_handles()
    assert _code(exc) == AMDSMI_STATUS_NOT_INIT


def test_uuid_follows_amdsmi_uuid_gen_and_is_shared_by_partitions() -> None:
    assert amdsmi_uuid(0x0123456789ABCDEF, 0x74A1) == "01ff74a1-0000-1000-8023-456789abcdef"
    s = _sim()
    h = s.amdsmi_get_processor_handles()[0]
    s.amdsmi_set_gpu_compute_partition(h, C.CPX)
    s.amdsmi_shut_down()
    s.amdsmi_init()
    handles = s.amdsmi_get_processor_handles()
    assert len(handles) == 8
    assert len({s.amdsmi_get_gpu_device_uuid(x) for x in handles}) == 1
    assert [s.amdsmi_get_gpu_kfd_info(x)["current_partition_id"] for x in handles] == list(range(8))
    assert len({s.amdsmi_get_gpu_device_bdf(x) for x in handles}) == 1


def test_handles_from_before_a_mode_change_fail_not_found_until_reinit() -> None:
    s = _sim()
    h = s.amdsmi_get_processor_handles()[0]
    s.amdsmi_set_gpu_compute_partition(h, C.DPX)
    with pytest.raises(AmdSmiLibraryException) as exc:
        s.amdsmi_get_gpu_compute_partition(h)
    assert _code(exc) == AMDSMI_STATUS_NOT_FOUND
    assert len(s.amdsmi_get_processor_handles()) == 1  # the enumeration is the one taken at init
    s.amdsmi_shut_down()
    s.amdsmi_init()
    assert [s.amdsmi_get_gpu_compute_partition(x) for x in s.amdsmi_get_processor_handles()] == ["DPX", "DPX"]


def test_compute_mode_not_offered_with_memory_mode_is_setting_unavailable() -> None:
    s = _sim()
    h = s.amdsmi_get_processor_handles()[0]
    s.amdsmi_set_gpu_compute_partition(h, C.CPX)
    s.amdsmi_shut_down()
    s.amdsmi_init()
    s.amdsmi_set_gpu_memory_partition(s.amdsmi_get_processor_handles()[0], M.NPS4)
    s.amdsmi_shut_down()
    s.amdsmi_init()
    h = s.amdsmi_get_processor_handles()[0]
    assert s.mode(0) == ("CPX", "NPS4")
    for mode in (C.SPX, C.DPX, C.TPX):
        with pytest.raises(AmdSmiLibraryException) as exc:
            s.amdsmi_set_gpu_compute_partition(h, mode)
        assert _code(exc) == AMDSMI_STATUS_SETTING_UNAVAILABLE
    with pytest.raises(AmdSmiLibraryException) as exc:
        s.amdsmi_set_gpu_memory_partition(h, M.NPS2)
    assert _code(exc) == AMDSMI_STATUS_SETTING_UNAVAILABLE


def test_busy_gpu_refuses_compute_change_and_any_process_blocks_memory_change() -> None:
    s = _sim("MI300X:2")
    s.add_process(1, 0, pid=42, vram_bytes=MiB)
    h0, h1 = s.amdsmi_get_processor_handles()
    with pytest.raises(AmdSmiLibraryException) as exc:
        s.amdsmi_set_gpu_compute_partition(h1, C.CPX)
    assert _code(exc) == AMDSMI_STATUS_BUSY
    s.amdsmi_set_gpu_compute_partition(h0, C.CPX)  # the other GPU is idle
    s.amdsmi_shut_down()
    s.amdsmi_init()
    with pytest.raises(AmdSmiLibraryException) as exc:
        s.amdsmi_set_gpu_memory_partition(s.amdsmi_get_processor_handles()[0], M.NPS4)
    assert _code(exc) == AMDSMI_STATUS_AMDGPU_RESTART_ERR
    assert s.mode(0) == ("CPX", "NPS1")


def test_partition_changes_need_root() -> None:
    s = _sim()
    s.set_privileged(False)
    with pytest.raises(AmdSmiLibraryException) as exc:
        s.amdsmi_set_gpu_compute_partition(s.amdsmi_get_processor_handles()[0], C.CPX)
    assert _code(exc) == AMDSMI_STATUS_NO_PERM


def test_memory_mode_set_is_refused_on_boards_rocm_smi_does_not_name() -> None:
    s = _sim("MI325X:1")  # rocm_smi accepts the memory mode only where the name has "mi" and "00x"
    with pytest.raises(AmdSmiLibraryException) as exc:
        s.amdsmi_set_gpu_memory_partition(s.amdsmi_get_processor_handles()[0], M.NPS4)
    assert _code(exc) == AMDSMI_STATUS_NOT_SUPPORTED


def test_event_reader_waits_then_reports_no_data() -> None:
    s = _sim()
    h = s.amdsmi_get_processor_handles()[0]
    reader = s.AmdSmiEventReader(h, [s.AmdSmiEvtNotificationType.VMFAULT])
    s.inject_event(0, 0, "THERMAL_THROTTLE")  # not asked for: never delivered
    with pytest.raises(AmdSmiLibraryException) as exc:
        reader.read(10)
    assert _code(exc) == AMDSMI_STATUS_NO_DATA
    s.inject_event(0, 0, "VMFAULT", "page fault at 0x1000")
    (ev,) = reader.read(10)
    assert ev["event"] == "VMFAULT" and ev["processor_handle"].value == h.value


def test_parameter_types_are_checked_like_the_library() -> None:
    s = _sim()
    with pytest.raises(s.AmdSmiParameterException):
        s.amdsmi_set_gpu_compute_partition(s.amdsmi_get_processor_handles()[0], "CPX")  # type: ignore[arg-type]
    with pytest.raises(s.AmdSmiParameterException):
        s.amdsmi_get_gpu_device_uuid(0)


def _set_mode(s: SimAmdSmi, compute: str, memory: str) -> None:
    """Reach a mode the way an operator would: compute first unless the memory mode forbids it."""
    model = AMD_MODELS["MI300X"]
    current = s.mode(0)
    order = [("c", compute), ("m", memory)] if model.is_valid(compute, current[1]) else [("m", memory), ("c", compute)]
    for kind, mode in order:
        h = s.amdsmi_get_processor_handles()[0]
        if kind == "c":
            s.amdsmi_set_gpu_compute_partition(h, C[mode])
        else:
            s.amdsmi_set_gpu_memory_partition(h, M[mode])
        s.amdsmi_shut_down()
        s.amdsmi_init()


@settings(max_examples=40, deadline=None)
@given(
    steps=st.lists(st.sampled_from(AMD_MODELS["MI300X"].valid_combinations()), min_size=1, max_size=6),
    busy_at=st.integers(min_value=0, max_value=5),
)
def test_property_logical_gpus_sum_to_physical_and_busy_blocks_changes(
    steps: list[tuple[str, str]], busy_at: int
) -> None:
    s = _sim()
    model = AMD_MODELS["MI300X"]
    for i, (compute, memory) in enumerate(steps):
        if i == busy_at:
            s.add_process(0, 0, pid=99, vram_bytes=MiB)
            before = s.mode(0)
            if before != (compute, memory):
                with pytest.raises(AmdSmiLibraryException):
                    _set_mode(s, compute, memory)
                assert s.mode(0) == before
            s.remove_process(99)
            s.amdsmi_shut_down()
            s.amdsmi_init()
            continue
        _set_mode(s, compute, memory)
        assert s.mode(0) == (compute, memory)
        handles = s.amdsmi_get_processor_handles()
        assert len(handles) == model.partitions(compute)
        vram = s.AmdSmiMemoryType.VRAM
        assert sum(s.amdsmi_get_gpu_memory_total(h, vram) for h in handles) == model.memory_mib * MiB
        assert sum(s.amdsmi_get_gpu_asic_info(h)["num_compute_units"] for h in handles) == model.compute_units
