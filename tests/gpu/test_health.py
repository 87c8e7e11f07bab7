"""XID policy and the drained-device tracker."""

from __future__ import annotations

import pytest

from gpusched.gpu.backend import Gpu, Instance, Inventory, XidEvent
from gpusched.gpu.health import (
    APPLICATION_XIDS,
    HealthAction,
    HealthTracker,
    decide,
    gpu_device_key,
    is_application_xid,
)


def _inst(uuid: str, gi: int, ci: int, start: int) -> Instance:
    return Instance(uuid, 1, "3g.40gb", 9, gi, ci, start, 4, 40448, 60)


INV = Inventory(
    gpus=(
        Gpu(0, "GPU-a", "NVIDIA H100 80GB HBM3", "H100-80GB", 81559, 132, False, False),
        Gpu(1, "GPU-b", "NVIDIA H100 80GB HBM3", "H100-80GB", 81559, 132, True, True,
            instances=(_inst("MIG-1", 2, 0, 0), _inst("MIG-2", 1, 0, 4))),
    )
)


@pytest.mark.parametrize("xid", sorted(APPLICATION_XIDS))
def test_application_xids_do_not_drain(xid: int) -> None:
    d = decide(XidEvent(0, xid), INV)
    assert d.action is HealthAction.APP_ERROR and d.devices == ("GPU-a",)
    assert d.reason == f"app_error: XID {xid}"
    assert is_application_xid(xid)


@pytest.mark.parametrize("xid", [48, 63, 64, 74, 79, 94, 95, 119])
def test_other_xids_drain_the_gpu_and_its_instances(xid: int) -> None:
    d = decide(XidEvent(1, xid), INV)
    assert d.action is HealthAction.DRAIN and d.reason == f"gpu_fault: XID {xid}"
    assert d.devices == ("GPU-b", "MIG-1", "MIG-2")


def test_mig_scoped_event_drains_only_that_instance() -> None:
    d = decide(XidEvent(1, 94, gi_id=1, ci_id=0), INV)
    assert d.devices == ("MIG-2",) and d.reason == "gpu_fault: XID 94 on MIG GI 1 CI 0"
    app = decide(XidEvent(1, 43, gi_id=2, ci_id=0), INV)
    assert app.action is HealthAction.APP_ERROR and app.devices == ("MIG-1",)


def test_unknown_instance_falls_back_to_whole_gpu() -> None:
    d = decide(XidEvent(1, 94, gi_id=9, ci_id=0), INV)
    assert d.devices == ("GPU-b", "MIG-1", "MIG-2") and "unknown MIG GI 9" in d.reason


def test_lost_gpu_drains_everything_and_unknown_gpu_gets_a_key() -> None:
    d = decide(XidEvent(1, 79, lost=True), INV)
    assert d.action is HealthAction.DRAIN and d.reason.startswith("gpu_lost")
    assert d.devices == ("GPU-b", "MIG-1", "MIG-2")
    gone = decide(XidEvent(7, 79, lost=True), INV)
    assert gone.devices == (gpu_device_key(7),)


def test_tracker_drain_resume_and_auto_resume() -> None:
    t = HealthTracker(auto_resume_after_s=600)
    assert t.apply(decide(XidEvent(0, 13), INV), now=0) == []
    assert t.apply(decide(XidEvent(1, 94, gi_id=1, ci_id=0), INV), now=100) == ["MIG-2"]
    assert t.apply(decide(XidEvent(0, 79, lost=True), INV), now=100) == ["GPU-a"]
    assert t.drain("MIG-1", "operator: maintenance", now=100)
    assert t.is_drained("MIG-2") and t.record("MIG-2") is not None
    # a repeat fault restarts the quiet period but keeps the original start time
    assert t.apply(decide(XidEvent(1, 94, gi_id=1, ci_id=0), INV), now=500) == []
    rec = t.record("MIG-2")
    assert rec is not None and (rec.since, rec.last_fault) == (100, 500)
    assert t.tick(now=1000) == []
    assert t.tick(now=1100) == ["MIG-2"]
    assert sorted(t.drained()) == ["GPU-a", "MIG-1"]  # lost and manual drains never auto-resume
    assert t.tick(now=10**9) == []
    assert t.resume("GPU-a") and not t.resume("GPU-a")
    assert HealthTracker().tick(now=10**9) == []
