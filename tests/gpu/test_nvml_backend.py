"""Contract tests for NvmlBackend: always against SimNVML, and against the real driver when one works.

Real-driver tests are read-only unless GPUSCHED_TEST_MIG_WRITE=1 (they then create and destroy a 1g
instance on the first MIG-enabled GPU). Everything needing test hooks (processes, XIDs, lost GPUs)
runs on the simulator only.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pynvml
import pytest

from gpusched.gpu.backend import (
    GpuBackend,
    GpuBusyError,
    GpuError,
    GpuInsufficientResourcesError,
    GpuInvalidArgumentError,
    GpuLostError,
    GpuNotFoundError,
    GpuNotSupportedError,
    GpuPermissionError,
    Inventory,
    XidEvent,
)
from gpusched.gpu.nvml import NvmlBackend, open_backend
from gpusched.gpu.profiles import MODEL_KEYS, MODELS, place_layout, profiles_for
from gpusched.gpu.simnvml import SimNVML


def _real_driver() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


HAVE_DRIVER = _real_driver()
MIG_WRITE = os.environ.get("GPUSCHED_TEST_MIG_WRITE") == "1"


@pytest.fixture(params=["sim", pytest.param("real", marks=pytest.mark.gpu)])
def backend(request: pytest.FixtureRequest) -> Iterator[NvmlBackend]:
    """The contract holds for both: this is why nvml.py takes the module as an argument."""
    if request.param == "real":
        if not HAVE_DRIVER:
            pytest.skip("no working NVIDIA driver (pynvml.nvmlInit failed)")
        b = NvmlBackend(pynvml)
    else:
        b = NvmlBackend(SimNVML.from_spec("A100-40GB,H100-80GB:2,H200", seed=7))
    yield b
    b.close()


@pytest.fixture
def sim_backend() -> Iterator[tuple[NvmlBackend, SimNVML]]:
    sim = SimNVML.from_spec("A100-80GB,H100-80GB", seed=11)
    b = NvmlBackend(sim)
    yield b, sim
    b.close()


# ---------------------------------------------------------------- read-only contract (sim + real)


def test_is_a_gpu_backend(backend: NvmlBackend) -> None:
    assert isinstance(backend, NvmlBackend)
    _: GpuBackend = backend


def test_inventory_contract(backend: NvmlBackend) -> None:
    inv = backend.inventory()
    assert isinstance(inv, Inventory)
    assert inv.driver_version and inv.backend in ("simnvml", "pynvml")
    assert len(inv.gpus) + len(inv.errors) >= 1
    for gpu in inv.gpus:
        assert gpu.uuid.startswith("GPU-") and gpu.name
        assert gpu.memory_total_mib > 0 and gpu.sm_count > 0
        assert gpu.memory_used_mib is not None and 0 <= gpu.memory_used_mib <= gpu.memory_total_mib
        if gpu.model in MODELS:
            assert gpu.sm_count == MODELS[gpu.model].sm_count
        if not gpu.mig_enabled:
            assert gpu.instances == ()
        used: set[int] = set()
        for inst in gpu.instances:
            assert inst.uuid.startswith("MIG-") and inst.gpu_index == gpu.index
            cells = set(range(inst.start, inst.start + inst.size))
            assert not cells & used
            used |= cells
        assert all(isinstance(c, int) for c in gpu.cpu_affinity)


def test_telemetry_contract(backend: NvmlBackend) -> None:
    inv = backend.inventory()
    for gpu in inv.gpus:
        util = backend.utilization(gpu.index)
        assert util is None if gpu.mig_enabled else isinstance(util, int) and 0 <= util <= 100
        for proc in backend.processes(gpu.uuid):
            assert proc.pid > 0 and proc.device_uuid
    ev = backend.wait_event(20)
    assert ev is None or isinstance(ev, XidEvent)


def test_unknown_uuid_is_not_found(backend: NvmlBackend) -> None:
    with pytest.raises(GpuNotFoundError):
        backend.processes("GPU-00000000-0000-0000-0000-000000000000")
    with pytest.raises(GpuNotFoundError):
        backend.destroy_instance("MIG-00000000-0000-0000-0000-000000000000")


@pytest.mark.skipif(not (HAVE_DRIVER and MIG_WRITE), reason="real MIG writes need GPUSCHED_TEST_MIG_WRITE=1")
@pytest.mark.gpu
def test_real_create_and_destroy_1g() -> None:
    b = NvmlBackend(pynvml)
    try:
        gpu = next((g for g in b.inventory().gpus if g.mig_enabled and g.model in MODELS), None)
        if gpu is None:
            pytest.skip("no MIG-enabled GPU of a known model")
        one = profiles_for(gpu.model)[0]
        used = {s for i in gpu.instances for s in range(i.start, i.start + i.size)}
        start = next((s for s in one.starts if s not in used), None)
        if start is None:
            pytest.skip("no free 1g slice")
        inst = b.create_instance(gpu.index, one.name, start)
        try:
            assert inst.profile == one.name and inst.start == start
            assert inst.uuid in {i.uuid for g in b.inventory().gpus for i in g.instances}
        finally:
            b.destroy_instance(inst.uuid)
    finally:
        b.close()


# ---------------------------------------------------------------- simulator-only behaviour


def test_mig_lifecycle(sim_backend: tuple[NvmlBackend, SimNVML]) -> None:
    b, _ = sim_backend
    with pytest.raises(GpuNotSupportedError):
        b.create_instance(1, "3g.40gb", 4)  # MIG off
    change = b.set_mig_mode(1, True)
    assert change.current and not change.pending and change.gpu_index == 1
    layout = place_layout("H100-80GB", ["3g.40gb", "2g.20gb", "2g.20gb"])
    made = [b.create_instance(1, name, start) for name, start in layout]
    assert [(i.profile, i.profile_id, i.start, i.size) for i in made] == [
        ("3g.40gb", 9, 4, 4), ("2g.20gb", 14, 0, 2), ("2g.20gb", 14, 2, 2)
    ]
    assert made[0].sm_count == 60 and made[0].memory_mib == 40448
    gpu = b.inventory().gpus[1]
    assert gpu.mig_enabled and gpu.mig_pending
    assert {i.uuid for i in gpu.instances} == {i.uuid for i in made}
    assert {(i.gi_id, i.ci_id) for i in gpu.instances} == {(i.gi_id, i.ci_id) for i in made}
    assert b.utilization(1) is None
    b.destroy_instance(made[0].uuid)
    assert len(b.inventory().gpus[1].instances) == 2
    with pytest.raises(GpuNotFoundError):
        b.destroy_instance(made[0].uuid)


def test_create_errors_map(sim_backend: tuple[NvmlBackend, SimNVML]) -> None:
    b, _ = sim_backend
    b.set_mig_mode(0, True)
    with pytest.raises(GpuInvalidArgumentError, match="valid profiles"):
        b.create_instance(0, "3g.20gb", 0)  # an A100-40GB name on an A100-80GB
    with pytest.raises(GpuInvalidArgumentError, match=r"valid starts: \[0, 4\]"):
        b.create_instance(0, "3g.40gb", 2)
    b.create_instance(0, "4g.40gb", 0)
    with pytest.raises(GpuInsufficientResourcesError):
        b.create_instance(0, "3g.40gb", 0)
    b.create_instance(0, "1g.10gb+me", 4)
    with pytest.raises(GpuInsufficientResourcesError):
        b.create_instance(0, "1g.10gb+me", 5)
    with pytest.raises(GpuInvalidArgumentError):
        b.create_instance(9, "1g.10gb", 0)


def test_failed_ci_create_leaves_nothing(sim_backend: tuple[NvmlBackend, SimNVML]) -> None:
    b, sim = sim_backend
    b.set_mig_mode(0, True)
    sim.fail_next("nvmlGpuInstanceCreateComputeInstance", pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
    with pytest.raises(GpuInsufficientResourcesError):
        b.create_instance(0, "7g.80gb", 0)
    assert b.inventory().gpus[0].instances == ()
    assert b.create_instance(0, "7g.80gb", 0).size == 8  # the slices really are free again


def test_destroy_busy_names_pids_and_destroys_nothing(sim_backend: tuple[NvmlBackend, SimNVML]) -> None:
    b, sim = sim_backend
    b.set_mig_mode(0, True)
    inst = b.create_instance(0, "2g.20gb", 4)
    sim.add_process(inst.uuid, 31337, 5 << 30)
    sim.add_process(inst.uuid, 31338, None)
    with pytest.raises(GpuBusyError, match="31337, 31338"):
        b.destroy_instance(inst.uuid)
    assert [i.uuid for i in b.inventory().gpus[0].instances] == [inst.uuid]
    procs = b.processes(inst.uuid)
    assert [(p.pid, p.used_memory_bytes) for p in procs] == [(31337, 5 << 30), (31338, None)]
    # the parent GPU's view attributes each process to its MIG device
    assert {p.device_uuid for p in b.processes(b.inventory().gpus[0].uuid)} == {inst.uuid}
    with pytest.raises(GpuInvalidArgumentError, match="whole GPU"):
        b.destroy_instance(b.inventory().gpus[0].uuid)
    sim.remove_process(31337)
    sim.remove_process(31338)
    b.destroy_instance(inst.uuid)
    assert b.inventory().gpus[0].instances == ()


def test_orphan_gi_makes_gpu_unschedulable(sim_backend: tuple[NvmlBackend, SimNVML]) -> None:
    b, sim = sim_backend
    b.set_mig_mode(0, True)
    h = sim.nvmlDeviceGetHandleByIndex(0)
    sim.nvmlDeviceCreateGpuInstance(h, 19)  # a GI without a CI, as another tool might leave it
    inv = b.inventory()
    assert 0 in inv.errors and "compute instance" in inv.errors[0]
    assert [g.index for g in inv.gpus] == [1]


def test_set_mig_mode_pending_while_busy(sim_backend: tuple[NvmlBackend, SimNVML]) -> None:
    b, sim = sim_backend
    gpu = b.inventory().gpus[0]
    sim.add_process(gpu.uuid, 4000, 1 << 30)
    sim.set_utilization(0, 55)
    assert b.utilization(0) == 55
    change = b.set_mig_mode(0, True)
    assert (change.current, change.pending) == (False, True) and "idle" in change.detail
    g = b.inventory().gpus[0]
    assert (g.mig_enabled, g.mig_pending) == (False, True) and g.memory_used_mib == 1024
    sim.remove_process(4000)
    change = b.set_mig_mode(0, True)
    assert (change.current, change.pending) == (True, False)


def test_permission_error_maps() -> None:
    b = NvmlBackend(SimNVML(["A100-40GB"], privileged=False))
    with pytest.raises(GpuPermissionError) as err:
        b.set_mig_mode(0, True)
    assert "root" in err.value.hint
    b.close()


def test_inventory_topology(sim_backend: tuple[NvmlBackend, SimNVML]) -> None:
    b, _ = sim_backend
    g0, g1 = b.inventory().gpus
    assert (g0.numa_node, g1.numa_node) == (0, 1)
    assert g0.cpu_affinity == tuple(range(32)) and g1.cpu_affinity == tuple(range(32, 64))
    assert g0.model == "A100-80GB" and g1.model == "H100-80GB" and g0.sm_count == 108


def test_wait_event_xid_scoped_and_timeout(sim_backend: tuple[NvmlBackend, SimNVML]) -> None:
    b, sim = sim_backend
    assert b.wait_event(10) is None  # registers lazily; events before registration are not seen
    sim.inject_xid(1, 48)
    sim.inject_xid(0, 13, gi=5, ci=0)
    assert b.wait_event(100) == XidEvent(gpu_index=1, xid=48)
    assert b.wait_event(100) == XidEvent(gpu_index=0, xid=13, gi_id=5, ci_id=0)
    t0 = time.monotonic()
    assert b.wait_event(50) is None
    assert time.monotonic() - t0 >= 0.045


def test_wait_event_in_thread_while_loop_calls(sim_backend: tuple[NvmlBackend, SimNVML]) -> None:
    b, sim = sim_backend
    b.wait_event(0)
    got: list[XidEvent | None] = []
    t = threading.Thread(target=lambda: got.append(b.wait_event(5000)))
    t.start()
    for _ in range(5):
        assert len(b.inventory().gpus) == 2
    sim.inject_xid(0, 94)
    t.join(timeout=5)
    assert got == [XidEvent(gpu_index=0, xid=94)]


def test_lost_gpu(sim_backend: tuple[NvmlBackend, SimNVML]) -> None:
    b, sim = sim_backend
    b.wait_event(0)
    sim.lose_gpu(1)
    assert b.wait_event(1000) == XidEvent(gpu_index=1, xid=79, lost=True)
    assert b.wait_event(10) is None  # reported once
    inv = b.inventory()
    assert [g.index for g in inv.gpus] == [0] and inv.errors[1].startswith("gpu_lost")
    with pytest.raises(GpuLostError):
        b.utilization(1)


def test_gpu_lost_before_registration_is_reported() -> None:
    sim = SimNVML.from_spec("H200:2")
    b = NvmlBackend(sim)
    sim.lose_gpu(0)
    assert b.wait_event(10) == XidEvent(gpu_index=0, xid=79, lost=True)
    b.close()
    assert b.wait_event(10) is None  # closed: nothing more, no exception


def test_open_backend_sim_and_errors() -> None:
    b = open_backend("H100-80GB:2")
    try:
        assert [g.model for g in b.inventory().gpus] == ["H100-80GB"] * 2
    finally:
        b.close()
    with pytest.raises(GpuInvalidArgumentError, match=re.escape(", ".join(MODEL_KEYS))):
        open_backend("Z100:1")


@pytest.mark.skipif(HAVE_DRIVER, reason="a driver is present here")
def test_open_backend_without_driver_hints_at_sim() -> None:
    with pytest.raises(GpuError) as err:
        open_backend(None)
    assert "gpuschedd --sim H100-80GB:2" in err.value.hint


def test_each_model_end_to_end(model: str) -> None:
    b = NvmlBackend(SimNVML([model], seed=5))
    b.set_mig_mode(0, True)
    names = [p.name for p in profiles_for(model)]
    layout = place_layout(model, [names[5], names[3], names[0]])
    made = [b.create_instance(0, n, s) for n, s in layout]
    inv: Any = b.inventory()
    assert [(i.profile, i.start) for i in inv.gpus[0].instances] == sorted(
        ((i.profile, i.start) for i in made), key=lambda x: x[1]
    )
    for inst in made:
        b.destroy_instance(inst.uuid)
    assert b.inventory().gpus[0].instances == ()
    b.close()
