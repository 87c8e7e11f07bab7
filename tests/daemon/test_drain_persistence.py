"""Drains survive a daemon restart with their quiet period: a GPU that keeps faulting stays out of
service for `health_auto_resume_s` after its last fault, restart or not."""

from __future__ import annotations

from pathlib import Path

from gpusched.daemon.devices import DeviceManager
from gpusched.daemon.store import Store
from gpusched.gpu.backend import XidEvent
from gpusched.gpu.nvml import NvmlBackend
from gpusched.gpu.simnvml import SimNVML


def test_a_restart_keeps_the_quiet_period_from_the_last_fault(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "state.db"))
    backend = NvmlBackend(SimNVML.from_spec("H100-80GB:1"))
    inventory = backend.inventory()
    gpu = inventory.gpus[0].uuid
    first = DeviceManager(store, backend, auto_resume_after_s=3600.0)
    first.on_event(XidEvent(gpu_index=0, xid=48), inventory, now=0.0)
    first.on_event(XidEvent(gpu_index=0, xid=48), inventory, now=7000.0)  # faults again while drained
    assert first.tick(7200.0) == []
    again = DeviceManager(store, backend, auto_resume_after_s=3600.0)  # the daemon restarted
    assert again.tick(7200.0) == []  # 200 s after the last fault: still out of service
    assert again.tick(10_600.0) == [gpu]  # 3600 s after it: back


def test_a_record_saved_before_the_last_fault_was_kept_still_loads(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "state.db"))
    store.set_meta("drained_devices", '{"GPU-x": {"reason": "gpu_fault: XID 48", "since": 5.0, "auto_resume": true}}')
    manager = DeviceManager(store, NvmlBackend(SimNVML.from_spec("H100-80GB:1")), auto_resume_after_s=100.0)
    assert manager.tick(104.0) == [] and manager.tick(105.0) == ["GPU-x"]
