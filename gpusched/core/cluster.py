"""The live usage of every schedulable device, and keeping it current.

`ClusterState` is built from a snapshot (GPUs + the allocations of active jobs); `commit` and
`release` (and `pause` / `unpause` of shares suspended in place) change the usage. It also keeps
what is derived from the usage until the usage changes (fingerprint, idle count, placement answers
in place_memo.py), copies itself copy-on-write for what-if questions, and records what it applied
so that cluster_sync.py can bring it to the next snapshot. placement.py's `Cluster` adds the rules
that choose devices.

Invariants `commit` keeps (and tests check): a device held exclusively holds nothing else; on a
shared device Σ fraction <= 1, Σ gpu_mem <= device memory, clients <= the MPS client limit, and in
`mps` mode each user's clients go to that user's own MPS server on the device (a share from another
user is placed there only when the caller allows it, `mps_any_uid`: those servers time-slice).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from typing import Self

from gpusched.core.devices import (
    _EPS,
    MPS_MAX_CLIENTS,
    DeviceUse,
    NumaKey,
    _Client,
    _Held,
    _mode,
    _share_fits,
    pause_on,
    precision_class,
)
from gpusched.core.place_memo import PlaceMemo
from gpusched.gpu.backend import Gpu
from gpusched.model import ACTIVE_STATES, Allocation, Job

# (job id, allocation, uid, precision, paused): one usage applied to a Cluster, see ClusterState.applied
Applied = tuple[int, Allocation, int, str | None, bool]


class ClusterState:
    """Live usage of all schedulable devices (placement.Cluster adds the placement rules)."""

    def __init__(self) -> None:
        self.devices: dict[str, DeviceUse] = {}
        self.by_gpu: dict[int, list[str]] = {}
        self._index: dict[str, int] = {}  # device -> its place in `devices` (fixed once built)
        self.held: dict[int, _Held] = {}
        self.overcommitted: set[str] = set()  # devices the snapshot already shows over-full
        self._fingerprint: tuple[object, ...] | None = None  # until the next change
        # place()'s answers while they hold (place_memo.py); None on what-if copies, which change
        # between almost every question they are asked
        self._memo: PlaceMemo | None = PlaceMemo()
        self._fp_parts: dict[str, tuple[object, ...]] = {}  # fingerprint per unchanged device
        self._room: bool | None = None  # has_room() until the next change
        self._idle: int | None = None  # idle_whole() until the next change
        # What usage was applied, in order: the snapshot's active jobs as adopted, then commits. With
        # `dirty` (devices a release, pause or unpause touched) it lets cluster_sync bring this cluster
        # to the next snapshot without a rebuild.
        self.applied: list[Applied] = []
        self.dirty: set[str] = set()
        # Copy on write: after copy() both clusters share their DeviceUse objects, and each copies a
        # device before it first changes it (a reservation's what-if touches a few devices of many).
        # None: every device is this cluster's own.
        self._owned: set[str] | None = None

    @classmethod
    def build(
        cls,
        gpus: Iterable[Gpu],
        active: Iterable[Job],
        *,
        share_modes: Mapping[str, str] | None = None,
        unschedulable: frozenset[str] = frozenset(),
        mps_owner: Mapping[str, int] | None = None,
        exclude: Iterable[str] = (),
        yielded: AbstractSet[int] = frozenset(),
    ) -> Self:
        """Devices from the GPUs, then every active job's allocation committed onto them.

        Devices in `unschedulable` or `exclude` (instances about to be destroyed) get no new jobs,
        but jobs already on them still count wherever they are known. Shares in `yielded` (suspended
        in place) hold their memory and slot but no compute.
        """
        self = cls()
        modes = share_modes or {}
        owners = mps_owner or {}
        blocked = set(unschedulable) | set(exclude)
        for gpu in gpus:
            if gpu.uuid in unschedulable:
                continue
            numa: NumaKey = gpu.numa_node if gpu.numa_node is not None else (gpu.cpu_affinity or None)
            if not gpu.mig_enabled:
                part = gpu.partition
                self._add(DeviceUse(gpu.uuid, gpu.index, "gpu", None, 1.0, gpu.memory_total_mib,
                                    _mode(modes.get(gpu.uuid)), numa, MPS_MAX_CLIENTS,
                                    owners.get(gpu.uuid), partition=part.compute_mode if part else None,
                                    part_count=max(1, part.count) if part else 1))
                continue
            for inst in gpu.instances:
                if inst.uuid in blocked:
                    continue
                frac = inst.sm_count / gpu.sm_count if gpu.sm_count else 0.0
                clients = max(1, math.floor(MPS_MAX_CLIENTS * frac))
                self._add(DeviceUse(inst.uuid, gpu.index, "mig", inst.profile, frac, inst.memory_mib,
                                    _mode(modes.get(inst.uuid)), numa, clients, owners.get(inst.uuid)))
        for job in active:
            if job.state in ACTIVE_STATES and job.allocation is not None:
                paused = job.id in yielded
                self._adopt(job, paused)  # a paused share is adopted paused: nothing to take off after
                self.applied.append((job.id, job.allocation, job.uid, job.spec.precision, paused))
        self.dirty.clear()
        return self

    def _add(self, dev: DeviceUse) -> None:
        self._index[dev.uuid] = len(self.devices)
        self.devices[dev.uuid] = dev
        self.by_gpu.setdefault(dev.gpu_index, []).append(dev.uuid)

    def _adopt(self, job: Job, paused: bool) -> None:
        """Record an existing allocation as it is, even if it breaks the rules (report, don't drop)."""
        alloc = job.allocation
        assert alloc is not None
        prec = precision_class(job.spec.precision)
        uuids = tuple(u for u in alloc.uuids if u in self.devices)
        for uuid in uuids:
            self.adopt_on(self.writable(uuid), job.id, alloc, job.uid, prec, paused)
        self.held[job.id] = _Held(uuids, alloc.share is not None)

    def adopt_on(self, dev: DeviceUse, job_id: int, alloc: Allocation, uid: int, prec: str | None,
                 paused: bool) -> None:
        """One device's part of `_adopt` (cluster_sync replays it per device, in the same order).

        A share suspended in place (`paused`) is adopted holding its memory and slot but no
        compute, as `pause_on` leaves it: counted first and taken off after, it made a device look
        over-full whenever the share that runs instead came before it in the snapshot."""
        if alloc.share is not None:
            mem = alloc.gpu_mem_mib or 0
            share = alloc.share or 0.0
            running = 0.0 if paused else share
            dev.clients[job_id] = _Client(running, mem, uid, prec, share)
            dev.uids = None
            dev.used_fraction += running
            dev.used_mem += mem
            if dev.holder is not None or dev.used_fraction > 1 + _EPS or dev.used_mem > dev.memory_mib:
                self.overcommitted.add(dev.uuid)
        else:
            if not dev.idle:
                self.overcommitted.add(dev.uuid)
            dev.holder = job_id
            dev.holder_prec = prec

    def copy(self) -> Self:
        """An independent copy for what-if questions (reservations, preemption); devices are
        copied when either side first changes them."""
        other = type(self)()
        other._memo = None
        other._fp_parts = dict(self._fp_parts)
        other.devices = dict(self.devices)
        other.by_gpu = self.by_gpu  # fixed once built
        other._index = self._index
        other._owned = set()
        self._owned = set()
        other.held = dict(self.held)
        other.overcommitted = set(self.overcommitted)
        other.applied = list(self.applied)
        other.dirty = set(self.dirty)
        return other

    # ---- changes -------------------------------------------------------------------------
    def commit(self, job: Job, alloc: Allocation) -> None:
        """Record a new allocation made by `place`; raises if it would break an invariant."""
        self._changed(grew=True)
        if job.id in self.held:
            raise ValueError(f"job {job.id} already holds devices")
        prec = precision_class(job.spec.precision)
        shared = alloc.share is not None
        for uuid in alloc.uuids:
            dev = self.writable(uuid)
            if shared:
                share = alloc.share or 0.0
                mem = alloc.gpu_mem_mib or 0
                if not _share_fits(dev, share, mem, job.uid, any_uid=True):  # place() applied the uid policy
                    raise ValueError(f"share does not fit on {uuid}")
                dev.clients[job.id] = _Client(share, mem, job.uid, prec, share)
                dev.uids = None
                dev.used_fraction += share
                dev.used_mem += mem
            else:
                if not dev.idle:
                    raise ValueError(f"device {uuid} is not idle")
                dev.holder = job.id
                dev.holder_prec = prec
        self.held[job.id] = _Held(tuple(alloc.uuids), shared)
        self.applied.append((job.id, alloc, job.uid, job.spec.precision, False))

    def release(self, job_id: int) -> None:
        """Free what a job holds (it ended, or a what-if says it will)."""
        held = self.held.pop(job_id, None)
        if held is None:
            return
        self._changed(freed=held.uuids)
        self.dirty.update(held.uuids)
        for uuid in held.uuids:
            if uuid not in self.devices:
                continue
            dev = self.writable(uuid)
            if dev.holder == job_id:
                dev.holder = None
                dev.holder_prec = None
            client = dev.clients.pop(job_id, None)
            dev.uids = None
            if client is not None:
                dev.used_fraction = max(0.0, dev.used_fraction - client.fraction)
                dev.used_mem = max(0, dev.used_mem - client.mem)
                if not dev.clients:
                    dev.used_fraction, dev.used_mem = 0.0, 0

    def writable(self, uuid: str) -> DeviceUse:
        """The device, this cluster's own to change (copied first if a copy shares it)."""
        self._fp_parts.pop(uuid, None)
        owned = self._owned
        if owned is None or uuid in owned:
            return self.devices[uuid]
        dev = self.devices[uuid] = self.devices[uuid].copy()
        owned.add(uuid)
        return dev

    def _changed(self, *, grew: bool = False, freed: Iterable[str] | None = None) -> None:
        """Usage changed: what was derived from it (fingerprint, placements) is stale.

        `grew`: usage was only added; else `freed` names the devices whose usage may have dropped
        (None: any). The placement memo keeps what still holds (place_memo.py).
        """
        self._fingerprint = None
        self._room = None
        self._idle = None
        if self._memo is None:  # a what-if copy: nothing is kept on it
            return
        if grew:
            self._memo.grew()
            return
        freed = tuple(freed) if freed is not None else None
        if freed is None:
            self._memo.freed(None)
        else:
            self._memo.freed(freed, self._could_help(freed))

    def free_mark(self) -> int:
        """A mark to ask `freed_since` with later (the placement memo logs the frees; a what-if
        copy, which memoises nothing, has no marks)."""
        return self._memo.mark() if self._memo is not None else -1

    def freed_since(self, mark: int) -> frozenset[str] | None:
        """The devices whose usage may have dropped since `mark` (all usage changes since were these
        frees, or additions); None when that is no longer known. A request that found no room at
        the mark can have room now only on these devices."""
        return self._memo.freed_since(mark) if self._memo is not None and mark >= 0 else None

    def _could_help(self, uuids: Iterable[str]) -> frozenset[object]:
        """Which kinds of placement question (place_memo.kind_of) devices freed here could answer:
        shares need a shared device, whole requests a GPU with MIG off, MIG requests their profile."""
        kinds: set[object] = set()
        for u in uuids:
            d = self.devices.get(u)
            if d is None:
                continue
            if d.shared:
                kinds.add("s")
            if d.kind == "gpu":
                kinds.add("g")
            else:
                kinds.add(("m", d.profile))
        return frozenset(kinds)

    def invalidate(self, devices: Iterable[str] | None = None) -> None:
        """cluster_sync changed these devices directly (None: any)."""
        self._changed(freed=devices)

    def devices_of(self, job_id: int) -> tuple[str, ...]:
        held = self.held.get(job_id)
        return held.uuids if held is not None else ()

    def pause(self, job_id: int) -> bool:
        """A share suspended in place: its compute is free, its memory and slot stay. False if the
        job holds no share here."""
        held = self.held.get(job_id)
        if held is None or not held.shared:
            self._changed(freed=())
            return False
        self._changed(freed=held.uuids)
        self.dirty.update(held.uuids)
        for uuid in held.uuids:
            if uuid in self.devices:
                pause_on(self.writable(uuid), job_id)
        return True

    def paused(self, job_id: int) -> bool:
        held = self.held.get(job_id)
        return held is not None and held.shared and all(
            (c := self.devices[u].clients.get(job_id)) is not None and c.fraction == 0 and c.share > 0
            for u in held.uuids if u in self.devices)

    def unpause(self, job_id: int) -> bool:
        """Give a paused share its compute back if it fits beside what runs now; False (nothing
        changed) if it does not."""
        held = self.held.get(job_id)
        if held is None or not held.shared:
            return False
        clients = [(self.devices[u], self.devices[u].clients.get(job_id)) for u in held.uuids if u in self.devices]
        if any(c is None or dev.used_fraction + c.share > 1 + _EPS for dev, c in clients):
            return False
        self._changed(grew=True)
        self.dirty.update(held.uuids)
        for uuid in held.uuids:
            if uuid in self.devices:
                dev = self.writable(uuid)
                c = dev.clients[job_id]
                dev.used_fraction += c.share - c.fraction
                dev.clients[job_id] = _Client(c.share, c.mem, c.uid, c.prec, c.share)
        return True

    def fingerprint(self) -> tuple[object, ...]:
        """What decides whether a request fits: per device, held or not and the shares on it.

        Equal fingerprints mean every placement that failed on one fails on the other, which lets
        the scheduler skip re-trying requests that found no room while nothing was freed. Kept until
        the next commit, release, pause or unpause (a pass asks twice, mostly with nothing changed).
        """
        if self._fingerprint is None:
            self._fingerprint = self._compute_fingerprint()
        return self._fingerprint

    def _compute_fingerprint(self) -> tuple[object, ...]:
        parts = self._fp_parts  # devices change through writable(), which drops their part
        out = []
        for uuid, d in self.devices.items():
            part = parts.get(uuid)
            if part is None:
                part = parts[uuid] = (
                    d.uuid, d.holder is not None, len(d.clients), round(d.used_fraction, 9), d.used_mem,
                    min((c.uid for c in d.clients.values()), default=-1) if d.mode == "mps" else 0, d.mps_owner)
            out.append(part)
        return tuple(out)

    def idle_whole(self) -> int:
        """Whole GPUs with nothing on them (for 'waiting for N whole GPUs (k idle now)')."""
        if self._idle is None:
            self._idle = sum(1 for d in self.devices.values() if d.kind == "gpu" and d.idle)
        return self._idle

    def has_room(self) -> bool:
        """Cheap test used to stop a pass early: is any device idle or any share slot open?"""
        if self._room is None:
            self._room = self._compute_room()
        return self._room

    def _compute_room(self) -> bool:
        return any(d.idle or (d.shared and d.holder is None and d.used_fraction < 1 - _EPS
                              and len(d.clients) < d.max_clients and d.used_mem < d.memory_mib)
                   for d in self.devices.values())

    # ---- checks --------------------------------------------------------------------------
    def violations(self) -> list[str]:
        """Broken invariants (empty when all is well); tests and the scheduler's self-check use it."""
        out: list[str] = []
        for d in self.devices.values():
            if d.holder is not None and d.clients:
                out.append(f"{d.uuid}: held exclusively by job {d.holder} and shared by {sorted(d.clients)}")
            if sum(c.fraction for c in d.clients.values()) > 1 + 1e-6:
                out.append(f"{d.uuid}: shares sum above 1")
            if sum(c.mem for c in d.clients.values()) > d.memory_mib:
                out.append(f"{d.uuid}: share memory above {d.memory_mib} MiB")
            if len(d.clients) > d.max_clients:
                out.append(f"{d.uuid}: more than {d.max_clients} clients")
        return out

