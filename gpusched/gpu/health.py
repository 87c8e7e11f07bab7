"""XID policy and drained-device bookkeeping. Pure: events and `now` in, decisions out.

Policy follows NVIDIA's k8s device plugin (reference §3): XIDs 13, 31, 43, 45, 68, 109 are
application errors (the job on that device is at fault; the device stays in service); every other XID
drains the device. An event scoped to a MIG instance (gi/ci set) drains only that instance; a lost
GPU drains the GPU and everything on it. The engine carries the decisions out.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from gpusched.gpu.backend import Inventory, XidEvent

APPLICATION_XIDS: frozenset[int] = frozenset({13, 31, 43, 45, 68, 109})


class HealthAction(StrEnum):
    APP_ERROR = "app_error"  # log it, attribute it to the job(s) on the devices; no drain
    DRAIN = "drain"  # take the devices out of service


@dataclass(frozen=True, slots=True)
class HealthDecision:
    """What to do about one event. `devices` are UUIDs (GPU and/or MIG) the action applies to."""

    action: HealthAction
    gpu_index: int
    xid: int
    devices: tuple[str, ...]
    reason: str  # e.g. "gpu_fault: XID 79", "app_error: XID 13", "gpu_lost: GPU 2 stopped answering"


def is_application_xid(xid: int) -> bool:
    return xid in APPLICATION_XIDS


def gpu_device_key(gpu_index: int) -> str:
    """Key for a GPU whose UUID is unknown (e.g. it was lost before an inventory saw it)."""
    return f"gpu-index:{gpu_index}"


def decide(event: XidEvent, inventory: Inventory) -> HealthDecision:
    """Map one XID event onto the devices it affects and what to do about them."""
    gpu = next((g for g in inventory.gpus if g.index == event.gpu_index), None)
    whole: tuple[str, ...] = (
        (gpu.uuid, *(i.uuid for i in gpu.instances)) if gpu is not None else (gpu_device_key(event.gpu_index),)
    )
    if event.lost:
        return HealthDecision(
            HealthAction.DRAIN, event.gpu_index, event.xid, whole,
            f"gpu_lost: GPU {event.gpu_index} stopped answering (XID {event.xid})",
        )
    scope = ""
    devices = whole
    if event.gi_id is not None and gpu is not None:
        matches = tuple(
            i.uuid
            for i in gpu.instances
            if i.gi_id == event.gi_id and (event.ci_id is None or i.ci_id == event.ci_id)
        )
        if matches:
            devices = matches
            scope = f" on MIG GI {event.gi_id}" + (f" CI {event.ci_id}" if event.ci_id is not None else "")
        else:
            # The instance is gone (or unknown): we cannot scope the fault, so treat the GPU as hit.
            scope = f" on unknown MIG GI {event.gi_id}, whole GPU assumed"
    if is_application_xid(event.xid):
        return HealthDecision(
            HealthAction.APP_ERROR, event.gpu_index, event.xid, devices, f"app_error: XID {event.xid}{scope}"
        )
    return HealthDecision(HealthAction.DRAIN, event.gpu_index, event.xid, devices, f"gpu_fault: XID {event.xid}{scope}")


@dataclass(frozen=True, slots=True)
class DrainRecord:
    """Why and since when a device is out of service."""

    device: str
    reason: str
    since: float
    last_fault: float
    auto_resume: bool  # XID drains may come back after a quiet period; manual and lost ones never do


class HealthTracker:
    """Drained devices with reasons. Time is passed in; the tracker never reads a clock."""

    def __init__(self, auto_resume_after_s: float | None = None) -> None:
        self.auto_resume_after_s = auto_resume_after_s
        self._drained: dict[str, DrainRecord] = {}

    def apply(self, decision: HealthDecision, now: float) -> list[str]:
        """Record a decision; returns the devices that were newly drained."""
        if decision.action is not HealthAction.DRAIN:
            return []
        auto = not decision.reason.startswith("gpu_lost")
        return [d for d in decision.devices if self.drain(d, decision.reason, now, auto_resume=auto)]

    def drain(self, device: str, reason: str, now: float, *, auto_resume: bool = False) -> bool:
        """Take a device out of service; a repeat fault refreshes its quiet-period clock.

        Returns True when the device was not drained before.
        """
        old = self._drained.get(device)
        if old is not None:
            self._drained[device] = DrainRecord(
                device, reason, old.since, max(old.last_fault, now), old.auto_resume and auto_resume
            )
            return False
        self._drained[device] = DrainRecord(device, reason, now, now, auto_resume)
        return True

    def resume(self, device: str) -> bool:
        """Put a device back in service (operator action); False when it was not drained."""
        return self._drained.pop(device, None) is not None

    def tick(self, now: float) -> list[str]:
        """Auto-resume XID-drained devices that have been quiet long enough; returns them."""
        if self.auto_resume_after_s is None:
            return []
        due = [
            d for d, r in self._drained.items() if r.auto_resume and now - r.last_fault >= self.auto_resume_after_s
        ]
        for d in due:
            del self._drained[d]
        return due

    def is_drained(self, device: str) -> bool:
        return device in self._drained

    def record(self, device: str) -> DrainRecord | None:
        return self._drained.get(device)

    def drained(self) -> dict[str, DrainRecord]:
        return dict(self._drained)
