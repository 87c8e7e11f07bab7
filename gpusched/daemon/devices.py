"""Device health and MIG layout changes: XID events, drains, resumes, and applying layouts.

This module carries out the GPU layer's decisions (gpu/health.py for XIDs, core/migplan.py for
layouts) and remembers drained devices across restarts. It never changes job state: the engine
asks it which devices are out of service and stops the jobs on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import Callable, Mapping

from gpusched.core.migplan import LayoutChange, plan_layout_change
from gpusched.daemon.store import Store
from gpusched.gpu.backend import Gpu, GpuBackend, GpuError, Inventory, XidEvent
from gpusched.gpu.health import HealthAction, HealthDecision, HealthTracker, decide, gpu_device_key
from gpusched.gpu.simamdsmi import SimAmdSmi
from gpusched.gpu.simnvml import SimNVML
from gpusched.model import Event

log = logging.getLogger("gpusched.devices")

_DRAINED_KEY = "drained_devices"
# How long one wait for a GPU event lasts. NVML's (and amdsmi's) wait cannot be interrupted, and the
# driver must not be shut down under it, so a daemon's stop waits for the wait under way to return:
# this bounds that (it was 500 ms, half a second of every stop and restart). Ten returns a second
# with no event cost nothing measurable.
EVENT_WAIT_MS = 100


class DeviceError(Exception):
    """An admin request about devices cannot be carried out; the message says why."""


class DeviceManager:
    """Health tracking and MIG operations for the engine."""

    def __init__(self, store: Store, backend: GpuBackend, auto_resume_after_s: float | None) -> None:
        self.store = store
        self.backend = backend
        self.health = HealthTracker(auto_resume_after_s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        saved = store.get_meta(_DRAINED_KEY)
        for device, rec in (json.loads(saved) if saved else {}).items():
            auto = rec["auto_resume"]
            self.health.drain(device, rec["reason"], rec["since"], auto_resume=auto)
            # the last fault restarts the quiet period (a record from before it was kept has only `since`)
            self.health.drain(device, rec["reason"], rec.get("last_fault", rec["since"]), auto_resume=auto)

    # ---- events from the driver ------------------------------------------------------------------

    def start_watching(self, on_event: Callable[[XidEvent], None]) -> None:
        """Block in the driver's event wait on a thread; hand each event to the loop."""
        loop = asyncio.get_running_loop()

        def watch() -> None:
            while not self._stop.is_set():
                try:
                    event = self.backend.wait_event(EVENT_WAIT_MS)
                except GpuError as exc:
                    log.error("GPU event wait failed: %s", exc.message)
                    self._stop.wait(5.0)
                    continue
                if event is not None:
                    with contextlib.suppress(RuntimeError):  # the loop closed while we waited
                        loop.call_soon_threadsafe(on_event, event)

        self._thread = threading.Thread(target=watch, name="gpusched-gpu-events", daemon=True)
        self._thread.start()

    def stop_watching(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)

    def on_event(self, event: XidEvent, inventory: Inventory, now: float) -> HealthDecision:
        """Apply the XID policy, record what happened, and persist new drains."""
        decision = decide(event, inventory)
        newly = self.health.apply(decision, now)
        kind = {HealthAction.APP_ERROR: "xid_app_error"}.get(decision.action, "gpu_lost" if event.lost else "gpu_fault")
        self.store.add_event(Event(at=now, kind=kind, message=decision.reason, gpu=event.gpu_index,
                                   device=",".join(decision.devices)))
        if newly:
            log.warning("drained %s: %s", ", ".join(newly), decision.reason)
        else:
            log.info("GPU %d: %s", event.gpu_index, decision.reason)
        if decision.action is HealthAction.DRAIN:  # new drains, and a repeat fault's fresh quiet period
            self._persist()
        return decision

    # ---- drains ----------------------------------------------------------------------------------

    def unschedulable(self, inventory: Inventory) -> frozenset[str]:
        """Device UUIDs no job may be given: drained ones, their instances, and unreadable GPUs."""
        drained = set(self.health.drained())
        out: set[str] = set(drained)
        for gpu in inventory.gpus:
            if gpu.uuid in drained or gpu_device_key(gpu.index) in drained or gpu.index in inventory.errors:
                out.add(gpu.uuid)
                out.update(i.uuid for i in gpu.instances)
        return frozenset(out)

    def drain_reason(self, uuid: str) -> str | None:
        rec = self.health.record(uuid)
        return rec.reason if rec is not None else None

    def drain(self, device: str, reason: str, inventory: Inventory, now: float) -> list[str]:
        uuids = resolve_device(device, inventory)
        drained = [u for u in uuids if self.health.drain(u, reason, now)]
        self.store.add_event(Event(at=now, kind="drain", message=reason, device=",".join(uuids)))
        self._persist()
        return drained

    def resume(self, device: str, inventory: Inventory, now: float, who: str) -> list[str]:
        drained = self.health.drained()
        try:
            uuids = resolve_device(device, inventory)
        except DeviceError:
            # a GPU lost before any inventory saw it is drained under its index (health.gpu_device_key)
            if not device.isdigit() or gpu_device_key(int(device)) not in drained:
                raise
            uuids = []
        index = next((g.index for g in inventory.gpus if device in (str(g.index), g.uuid)), None)
        if device.isdigit() or index is not None:
            uuids.append(gpu_device_key(int(device) if index is None else index))
        resumed = [u for u in uuids if u in drained and self.health.resume(u)]
        if resumed:
            self.store.add_event(Event(at=now, kind="resume", message=f"resumed by {who}", device=",".join(resumed)))
            self._persist()
        return resumed

    def tick(self, now: float) -> list[str]:
        """Auto-resume devices whose quiet period has passed (if configured)."""
        resumed = self.health.tick(now)
        if resumed:
            self.store.add_event(Event(at=now, kind="resume", message="quiet period passed",
                                       device=",".join(resumed)))
            self._persist()
        return resumed

    def _persist(self) -> None:
        self.store.set_meta(_DRAINED_KEY, json.dumps({
            d: {"reason": r.reason, "since": r.since, "last_fault": r.last_fault, "auto_resume": r.auto_resume}
            for d, r in self.health.drained().items()
        }))

    # ---- MIG layouts -----------------------------------------------------------------------------

    def plan_layout(self, gpu: Gpu, target: list[str], busy: Mapping[str, int]) -> LayoutChange:
        """What `mig apply` would do; instances with foreign processes count as busy too."""
        held = dict(busy)
        for inst in gpu.instances:
            if inst.uuid not in held and self.backend.processes(inst.uuid):
                held[inst.uuid] = 0
        change = plan_layout_change(gpu.model, gpu.instances, held, target)
        if change.error and any(v == 0 for v in held.values()):
            change = LayoutChange(error=change.error.replace("(job 0)", "(processes not started by gpusched)"))
        return change

    def apply_layout(self, gpu: Gpu, change: LayoutChange, now: float) -> list[str]:
        """Destroy, then create, as planned; if the driver refuses a step, undo what was done.

        Blocking: call it off the event loop. On failure the GPU is put back to its old layout (the
        same profiles at the same placements; re-created instances get new UUIDs) and the driver's
        error is raised with what was rolled back.
        """
        done: list[str] = []
        destroyed: list[tuple[str, int]] = []
        created: list[str] = []
        old = {i.uuid: i for i in gpu.instances}
        try:
            for uuid in change.destroy:
                self.backend.destroy_instance(uuid)
                destroyed.append((old[uuid].profile, old[uuid].start))
                done.append(f"destroyed {uuid}")
            for profile, start in change.create:
                inst = self.backend.create_instance(gpu.index, profile, start)
                created.append(inst.uuid)
                done.append(f"created {profile} at {start}: {inst.uuid}")
        except GpuError as exc:
            self._roll_back(gpu, created, destroyed)
            exc.message = f"{exc.message}; rolled back: {len(created)} new instance(s) removed, " \
                          f"{len(destroyed)} destroyed instance(s) re-created"
            raise
        for line in done:
            kind = "mig_destroy" if line.startswith("destroyed") else "mig_create"
            self.store.add_event(Event(at=now, kind=kind, message=line, gpu=gpu.index))
        return done

    def _roll_back(self, gpu: Gpu, created: list[str], destroyed: list[tuple[str, int]]) -> None:
        for uuid in reversed(created):
            try:
                self.backend.destroy_instance(uuid)
            except GpuError as exc:
                log.error("GPU %d: rollback could not destroy %s: %s", gpu.index, uuid, exc.message)
        for profile, start in destroyed:
            try:
                self.backend.create_instance(gpu.index, profile, start)
            except GpuError as exc:
                log.error("GPU %d: rollback could not re-create %s at %d: %s", gpu.index, profile, start,
                          exc.message)


def resolve_device(device: str, inventory: Inventory) -> list[str]:
    """A GPU index, GPU UUID or MIG UUID -> the UUIDs it covers (a GPU covers its instances)."""
    for gpu in inventory.gpus:
        if device in (str(gpu.index), gpu.uuid):
            return [gpu.uuid, *(i.uuid for i in gpu.instances)]
        for inst in gpu.instances:
            if device == inst.uuid:
                return [inst.uuid]
    known = ", ".join(str(g.index) for g in inventory.gpus)
    raise DeviceError(f"no GPU or MIG instance {device!r} (GPU indices: {known}; or give a GPU-/MIG- UUID)")


def amd_simulator_of(backend: GpuBackend) -> SimAmdSmi | None:
    """The simulated amdsmi behind `backend`, if it is one (`gpuschedd --sim MI300X:2`)."""
    module = getattr(backend, "module", None)
    return module if isinstance(module, SimAmdSmi) else None


def simulator_of(backend: GpuBackend) -> SimNVML | None:
    """The simulated driver behind `backend`, if it is one (for `--sim`-only operations)."""
    module = getattr(backend, "module", None)
    return module if isinstance(module, SimNVML) else None
