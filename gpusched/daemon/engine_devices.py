"""The engine's side of the GPUs: inventory, XID events and drains, MIG layouts and MIG mode."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

from gpusched.core.migplan import LayoutChange
from gpusched.core.scheduler import SetMigMode, SetPartitionMode
from gpusched.daemon.devices import DeviceError, simulator_of
from gpusched.daemon.engine_core import EngineCore
from gpusched.daemon.recovery import StopRequest
from gpusched.gpu.backend import Gpu, GpuError, Inventory, XidEvent
from gpusched.gpu.health import HealthAction
from gpusched.model import (
    Event,
    JobState,
)

log = logging.getLogger("gpusched.engine")


class DevicesMixin(EngineCore):
    """GPU inventory, health events and MIG changes."""

    async def refresh_inventory(self) -> None:
        try:
            fresh = await asyncio.to_thread(self.backend.inventory)
        except GpuError as exc:
            log.error("cannot read GPU inventory: %s", exc.message)
        else:
            self.inventory = fresh
            self.last_seen.update((g.index, g) for g in fresh.gpus)
            if _placement_view(fresh.gpus) != _placement_view(self.scheduler_gpus):
                self.scheduler_gpus = fresh.gpus
        self.checkpoints.observe(self.inventory)  # the driver version: r550+ to checkpoint, r580+ to move

    def _on_gpu_event(self, event: XidEvent) -> None:
        """An XID (or a lost GPU) from the driver: apply the policy to the jobs on those devices."""
        now = self.clock()
        self.metrics.record_xid(event.gpu_index, event.xid)
        decision = self.devices.on_event(event, self._inventory_for(event), now)
        hit = set(decision.devices)
        for job in self.active_jobs():
            if job.allocation is None:
                continue
            # (a GPU lost before any inventory of this daemon saw it, e.g. while it was down: the
            # event cannot name its devices, but the jobs recorded on it are hit all the same)
            lost_here = event.lost and any(d.gpu_index == event.gpu_index for d in job.allocation.devices)
            if not hit & set(job.allocation.uuids) and not lost_here:
                continue
            self.store.add_event(Event(at=now, kind=decision.action.value, message=decision.reason,
                                       gpu=event.gpu_index, job_id=job.id))
            if decision.action is HealthAction.DRAIN:
                final = JobState.PREEMPTED if job.spec.requeue else JobState.FAILED
                self._request_stop(job, StopRequest(final, decision.reason))
        if event.lost:
            self._spawn(self.refresh_inventory())
        self._notify()  # watchers (gpusched top) show the event
        self.wake()

    def _inventory_for(self, event: XidEvent) -> Inventory:
        """The inventory an event is decided against: the current one, plus the GPU it is about as
        it was last seen when the current one no longer lists it (a GPU that fell off the bus is
        drained under its own UUIDs, which `gpus resume` knows, not under a key nothing resolves)."""
        if any(g.index == event.gpu_index for g in self.inventory.gpus) or event.gpu_index not in self.last_seen:
            return self.inventory
        gpus = sorted((*self.inventory.gpus, self.last_seen[event.gpu_index]), key=lambda g: g.index)
        return dataclasses.replace(self.inventory, gpus=tuple(gpus))

    def _reserved_interactive(self) -> frozenset[str]:
        out: set[str] = set()
        for gpu in self.inventory.gpus:
            gpu_config = self.config.gpus.get(str(gpu.index))
            if gpu_config is not None and gpu_config.interactive:
                out.add(gpu.uuid)
                out.update(i.uuid for i in gpu.instances)
        return frozenset(out)

    def _mps_owners(self) -> dict[str, int]:
        """An MPS server serves one uid at a time: the uid of the shares running on each device."""
        owners: dict[str, int] = {}
        modes = self.share_modes()
        for job in self.active_jobs():
            if job.allocation is not None and job.allocation.share is not None:
                for uuid in job.allocation.uuids:
                    if modes.get(uuid) == "mps":
                        owners[uuid] = job.uid
        return owners

    def drain(self, device: str, reason: str) -> list[str]:
        return self.devices.drain(device, reason, self.inventory, self.clock())

    def resume_device(self, device: str, who: str) -> list[str]:
        resumed = self.devices.resume(device, self.inventory, self.clock(), who)
        self.wake()
        return resumed

    def busy_devices(self) -> dict[str, int]:
        """Device UUID -> the job holding it."""
        return {uuid: j.id for j in self.active_jobs() if j.allocation
                for uuid in j.allocation.uuids}

    async def apply_mig_layout(
        self, gpu_index: int, layout: list[str], dry_run: bool
    ) -> tuple[LayoutChange, list[str]]:
        """Plan (and unless `dry_run`, carry out) a declarative MIG layout for one GPU."""
        gpu = next((g for g in self.inventory.gpus if g.index == gpu_index), None)
        if gpu is None:
            raise DeviceError(f"no GPU {gpu_index}")
        if not gpu.mig_enabled:
            raise DeviceError(f"GPU {gpu_index} is not in MIG mode; an administrator enables it with "
                              f"`nvidia-smi -i {gpu_index} -mig 1` while the GPU is idle")
        change = await asyncio.to_thread(self.devices.plan_layout, gpu, layout, self.busy_devices())
        if change.error is not None or dry_run:
            return change, []
        try:
            done = await asyncio.to_thread(self.devices.apply_layout, gpu, change, self.clock())
            for _ in done:  # one entry per instance created or destroyed
                self.metrics.record_mig_reconfiguration(gpu_index)
        finally:
            await self.refresh_inventory()
            self.wake()
        return change, done

    async def apply_static_layouts(self, only: set[int] | None = None) -> list[str]:
        """Give GPUs configured with `mig = [...]` that layout (idle instances only are changed), and switch
        simulated GPUs configured with any MIG setting into MIG mode (only while no job holds them).

        Returns what could not be done, one line per GPU (`gpus.N.mig: why`); those GPUs are tried
        again at each tick until it is done or the config changes (`retry_layouts`)."""
        problems: list[str] = []
        self.layouts_pending = set()
        for key, gpu_config in sorted(self.config.gpus.items()):
            index = int(key)
            if gpu_config.mig is None or (only is not None and index not in only):
                continue
            gpu = next((g for g in self.inventory.gpus if g.index == index), None)
            if gpu is None:
                log.error("config gpus.%s: there is no GPU %s", key, key)
                continue
            if not gpu.mig_enabled and simulator_of(self.backend) is not None:
                holder = self._holder_of(index)
                if holder is not None:  # (a simulated GPU switched under a job gave its slices away)
                    problems.append(f"gpus.{key}.mig: GPU {index} is in use by job {holder}; it goes into MIG "
                                    "mode once idle")
                    self.layouts_pending.add(index)
                    continue
                await asyncio.to_thread(self.backend.set_mig_mode, index, True)  # a simulated GPU starts as told
                await self.refresh_inventory()
            if gpu_config.mig == "dynamic":
                continue  # the scheduler plans this GPU's layout from demand
            live = next((g for g in self.inventory.gpus if g.index == index), gpu)
            if self.config.mode == "slurm-node" and live.instances:
                # The config's layout is the starting one: once a GPU has instances, Slurm's gres.conf
                # names them and Slurm's jobs (which gpusched does not see as busy) may hold them.
                if sorted(i.profile for i in live.instances) != sorted(gpu_config.mig):
                    problems.append(f"gpus.{key}.mig: slurm-node mode: GPU {index} keeps the layout Slurm was "
                                    "told of; change it with `gpusched slurm relayout`")
                continue
            try:
                change, done = await self.apply_mig_layout(index, gpu_config.mig, dry_run=False)
            except (DeviceError, GpuError) as exc:
                problems.append(f"gpus.{key}.mig: {getattr(exc, 'message', str(exc))}")
                continue
            if change.error is not None:
                problems.append(f"gpus.{key}.mig: {change.error}; applied once GPU {index} is idle")
                self.layouts_pending.add(index)
            for line in done:
                log.info("GPU %d: %s", index, line)
        for line in problems:
            log.warning("config %s", line)
        return problems

    async def retry_layouts(self) -> None:
        """Each tick: the configured layouts a busy GPU kept from being applied, once it is idle."""
        idle = {i for i in self.layouts_pending if self._holder_of(i) is None}
        if idle:
            left = self.layouts_pending - idle
            await self.apply_static_layouts(only=idle)
            self.layouts_pending |= left

    def _holder_of(self, gpu_index: int) -> int | None:
        """A job holding the GPU or one of its instances, if any."""
        return next((j.id for j in self.active_jobs() if j.allocation is not None
                     and any(d.gpu_index == gpu_index for d in j.allocation.devices)), None)

    async def _set_mig_mode(self, action: SetMigMode) -> None:
        """Switch an idle dynamic GPU's MIG mode; the driver may leave it pending (a process appeared,
        or a reset is needed): that is logged and recorded, and the scheduler sees the real mode."""
        index, word = action.gpu_index, "on" if action.enabled else "off"
        if any(j.allocation is not None and any(d.gpu_index == index for d in j.allocation.devices)
               for j in self.active_jobs()):
            log.warning("GPU %d: MIG mode %s skipped: a job holds it now", index, word)
            return
        try:
            change = await asyncio.to_thread(self.backend.set_mig_mode, index, action.enabled)
        except GpuError as exc:
            log.warning("GPU %d: MIG mode %s failed: %s", index, word, exc.message)
            change = None
        await self.refresh_inventory()
        if change is not None:
            done = change.current == action.enabled and not change.pending
            message = f"MIG mode {word}: {action.reason}" if done else \
                f"MIG mode {word} requested, not in effect: {change.detail or 'pending'} ({action.reason})"
            self.metrics.record_mig_reconfiguration(index)
            self.store.add_event(Event(at=self.clock(), kind="mig_mode", gpu=index, message=message))
        self.wake()

    async def _set_partition_mode(self, action: SetPartitionMode) -> None:
        """Change an idle AMD physical GPU's partition mode, then re-read the inventory: its logical
        GPUs come back with new indices and UUIDs, those of the GPUs after it with new indices. A
        refusal (a process appeared, the driver said no) is logged and recorded; the pass goes on
        and jobs elsewhere are untouched."""
        p = action.physical_index
        mine = [g for g in self.inventory.gpus if g.partition is not None and g.partition.physical_index == p]
        before = f"{mine[0].partition.compute_mode}/{mine[0].partition.memory_mode}" if mine and mine[0].partition \
            else "?"
        target = f"{action.compute}/{action.memory}"
        # by UUID (indices are what a change renumbers): a job on this physical GPU, or on one after
        # it, whose logical GPUs the change would renumber under its ROCR_VISIBLE_DEVICES
        # (a device the inventory no longer lists cannot be placed: it might be any of them)
        listed = {g.uuid for g in self.inventory.gpus}
        renumbered = {g.uuid for g in self.inventory.gpus
                      if g.partition is not None and g.partition.physical_index >= p}
        holder = next((j.id for j in self.active_jobs() if j.allocation is not None
                       and (renumbered.intersection(j.allocation.uuids) or not listed.issuperset(j.allocation.uuids))),
                      None)
        if holder is not None:
            log.warning("partition mode of GPU %d: %s -> %s skipped: job %d runs on it, on a GPU after it or on "
                        "a GPU the inventory no longer lists",
                        p, before, target, holder)
            return
        try:
            change = await asyncio.to_thread(self.backend.set_partition_mode, p, action.compute, action.memory)
        except GpuError as exc:
            log.warning("partition mode of GPU %d: %s -> %s failed: %s", p, before, target, exc.message)
            self.store.add_event(Event(at=self.clock(), kind="partition_mode", gpu=p,
                                       message=f"{before} -> {target} refused: {exc.message} ({action.reason})"))
            change = None
        await self.refresh_inventory()
        if change is not None:
            log.info("partition mode of GPU %d: %s -> %s (%s)", p, before, target, action.reason)
            self.store.add_event(Event(at=self.clock(), kind="partition_mode", gpu=p,
                                       message=f"partition mode {before} -> {target}: {action.reason}"))
        self.wake()

    async def _gpu_call(self, fn: Callable[..., object], *args: object) -> bool:
        """Run a blocking backend call off the loop; False (logged) if the driver refused."""
        ok = True
        try:
            await asyncio.to_thread(fn, *args)
        except GpuError as exc:
            ok = False
            log.warning("%s%r failed: %s", getattr(fn, "__name__", "gpu call"), args, exc.message)
        await self.refresh_inventory()
        self.wake()
        return ok


def _placement_view(gpus: tuple[Gpu, ...]) -> tuple[Gpu, ...]:
    """The GPUs as placement sees them: all but the memory in use, which moves at every read on a
    real driver. The scheduler is handed the same tuple while this stays the same, so it keeps
    its placement view (core/cluster_sync.py) instead of rebuilding it at every inventory tick."""
    return tuple(dataclasses.replace(g, memory_used_mib=None) for g in gpus)
