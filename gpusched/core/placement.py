"""Fitting requests onto devices: whole GPUs, MIG instances and MPS / time-sliced shares.

`Cluster` is the live usage of every schedulable device (cluster.py: built from a snapshot, changed
by `commit` and `release`, kept current between passes) plus the rules here: `place(job)` proposes
an Allocation without changing anything. The scheduler uses a copy of a Cluster to ask "when would
this job fit" (reservations) and "what if these jobs were preempted".

Rules, in order of preference (each a tie-breaker for the one before):
- precision affinity: half (fp16/bf16) and full (fp32/tf32) jobs kept on different devices when
  there is a choice, because TF32 is switched off per process and mixed kernels slow each other;
- exclusive requests prefer `exclusive`-mode devices and leave share-mode devices for sharers;
- best fit: the fullest GPU / the fullest shared device that still fits, so large holes stay open;
- whole GPUs: all on one NUMA node when one node has enough, the node with the fewest free first.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from collections.abc import Set as AbstractSet

from gpusched.construct import construct, fields_of
from gpusched.core.cluster import Applied as Applied
from gpusched.core.cluster import ClusterState
from gpusched.core.devices import SHARE_MODES as SHARE_MODES
from gpusched.core.devices import DeviceUse, _share_fits, precision_class
from gpusched.core.devices import ShareMode as ShareMode
from gpusched.core.devices import job_env as job_env
from gpusched.core.satisfiable import offered_profiles as offered_profiles
from gpusched.core.satisfiable import unsatisfiable_reason as unsatisfiable_reason
from gpusched.model import (
    AllocatedDevice,
    Allocation,
    Job,
    MigRequest,
    PartitionRequest,
    ShareRequest,
    WholeRequest,
)

Request = WholeRequest | MigRequest | ShareRequest | PartitionRequest


class Cluster(ClusterState):
    """The devices' usage (cluster.py) and where a request would go on it."""

    # ---- proposals -----------------------------------------------------------------------
    def place(self, job: Job, forbidden: AbstractSet[str] = frozenset(), *,
              mps_any_uid: bool = False, only: Collection[str] | None = None) -> Allocation | None:
        """The best allocation for the job on what is free now, or None. Changes nothing.

        `forbidden` devices are not considered (e.g. devices reserved for interactive jobs), nor,
        when `only` is given, any device outside it (the same as forbidding all the others).
        `mps_any_uid` lets a share join an MPS device where other users' servers run (it still
        prefers one of its own or an empty one).
        """
        req = job.spec.request
        if only is not None:
            return self._place(job, req, forbidden, mps_any_uid, self._pool(only))
        # What the answer depends on: the request (and uid for shares), the precision (affinity
        # and env), the exclusions and the uid policy. Not the job's id: jobs of one shape share it.
        key: tuple[object, ...] | None = None
        memo = self._memo
        if memo is not None and isinstance(forbidden, frozenset):
            if isinstance(req, WholeRequest):
                key = ("g", req.gpus, job.spec.precision, forbidden)
            elif isinstance(req, MigRequest):
                key = ("m", req.profile, job.spec.precision, forbidden)
            elif isinstance(req, PartitionRequest):
                key = ("p", req.mode, req.gpus, job.spec.precision, forbidden)
            else:
                key = ("s", req.fraction, req.gpu_mem_mib, job.uid, job.spec.precision, forbidden, mps_any_uid)
            known, kept, freed = memo.lookup(key)
            if known:
                return kept
            if freed is not None and not (isinstance(req, (WholeRequest, PartitionRequest)) and req.gpus > 1):
                # it found no room before and only these devices have room they did not have then
                # (the pickers' choice does not depend on the order they see devices in: every
                # key ends in a unique index or uuid; the devices' order is kept all the same)
                if len(freed) == 1 and not self._fits_one(freed, job, req, forbidden, mps_any_uid):
                    memo.record(key, None)  # the usual re-ask after an end: still no room
                    return None
                alloc = self._place(job, req, forbidden, mps_any_uid, self._pool(freed))
            else:
                alloc = self._place(job, req, forbidden, mps_any_uid)
            memo.record(key, alloc)
            return alloc
        return self._place(job, req, forbidden, mps_any_uid)

    def _fits_one(self, uuids: Collection[str], job: Job, req: Request, forbidden: AbstractSet[str],
                  mps_any_uid: bool) -> bool:
        """Would the one-device request fit on this one device? What the pickers below test for a
        pool of one, without building the pool or the allocation."""
        (uuid,) = uuids
        d = self.devices.get(uuid)
        if d is None or uuid in forbidden or uuid not in self._index:
            return False
        if isinstance(req, ShareRequest):
            return _share_fits(d, req.fraction, req.gpu_mem_mib, job.uid, any_uid=mps_any_uid)
        if isinstance(req, MigRequest):
            return d.kind == "mig" and d.profile == req.profile and d.idle
        if isinstance(req, PartitionRequest):
            return d.kind == "gpu" and d.partition == req.mode and d.idle
        return d.kind == "gpu" and d.idle

    def _pool(self, uuids: Collection[str]) -> list[DeviceUse]:
        """These devices, in the cluster's order."""
        index = self._index
        if len(uuids) == 1:  # the usual case: one job's or one release's device
            (only,) = uuids
            return [self.devices[only]] if only in index else []
        return [self.devices[u] for u in sorted((u for u in uuids if u in index), key=index.__getitem__)]

    def _place(self, job: Job, req: Request, forbidden: AbstractSet[str], mps_any_uid: bool,
               pool: Iterable[DeviceUse] | None = None) -> Allocation | None:
        """The placement itself; `pool` limits the devices looked at (default: all)."""
        devices = self.devices.values() if pool is None else pool
        if isinstance(req, WholeRequest):
            if self.idle_whole() < req.gpus:
                return None  # not enough idle GPUs, forbidden or not
            devs = self._pick_whole(devices, req.gpus, forbidden)
            if devs is None:
                return None
            return _allocation([_alloc_dev(d) for d in devs], float(len(devs)), job_env(job))
        if isinstance(req, PartitionRequest):
            free = [d for d in devices if d.kind == "gpu" and d.partition == req.mode and d.idle
                    and d.uuid not in forbidden]
            if len(free) < req.gpus:
                return None
            devs = _best_whole(free, req.gpus)
            # charged its share of the physical GPU: a CPX logical GPU is an eighth of an MI300X
            return _allocation([_alloc_dev(d) for d in devs], sum(1.0 / d.part_count for d in devs), job_env(job))
        prec = precision_class(job.spec.precision)
        if isinstance(req, MigRequest):
            dev = self._pick_mig(devices, req.profile, prec, forbidden)
            if dev is None:
                return None
            return _allocation([_alloc_dev(dev)], dev.compute_fraction, job_env(job))
        dev = self._pick_share(devices, req.fraction, req.gpu_mem_mib, job.uid, prec, forbidden, mps_any_uid)
        if dev is None:
            return None
        return _allocation([_alloc_dev(dev)], req.fraction * dev.compute_fraction, job_env(job), share=req.fraction,
                           gpu_mem_mib=req.gpu_mem_mib)

    def _gpu_penalty(self, gpu_index: int, prec: str | None) -> int:
        """Jobs of the other precision class on the same physical GPU."""
        if prec is None:
            return 0
        n = 0
        for uuid in self.by_gpu.get(gpu_index, ()):
            n += sum(1 for p in self.devices[uuid].precs() if p != prec)
        return n

    def _gpu_idle_fraction(self, gpu_index: int) -> float:
        return sum(self.devices[u].compute_fraction for u in self.by_gpu.get(gpu_index, ())
                   if self.devices[u].idle)

    def _pick_whole(self, devices: Iterable[DeviceUse], n: int, forbidden: AbstractSet[str]) -> list[DeviceUse] | None:
        free = [d for d in devices if d.kind == "gpu" and d.idle and d.uuid not in forbidden]
        if len(free) < n:
            return None
        return _best_whole(free, n)

    def whole_after_releases(self, n: int, forbidden: AbstractSet[str],
                             order: Sequence[int]) -> tuple[int, list[DeviceUse]] | None:
        """Releasing the jobs in `order` one by one: after which release (its index) do n whole GPUs
        outside `forbidden` stand idle, and which would place() give then? None: never.

        What a copy that releases job after job and asks place() each time answers, without the
        copy: a GPU is idle once every job on it is released, and which GPUs place() picks depends
        only on which are idle (a reservation for an n-GPU job waits for most of the node).
        """
        step = {jid: i for i, jid in enumerate(order)}
        never = len(order)
        when: list[tuple[int, DeviceUse]] = []
        for d in self.devices.values():
            if d.kind != "gpu" or d.uuid in forbidden:
                continue
            if d.idle:
                when.append((-1, d))
                continue
            last = step.get(d.holder, never) if d.holder is not None else -1
            for jid in d.clients:
                last = max(last, step.get(jid, never))
            if last < never:
                when.append((last, d))
        if len(when) < n:
            return None
        at = max(sorted(t for t, _ in when)[n - 1], 0)
        return at, _best_whole([d for t, d in when if t <= at], n)

    def _pick_mig(self, devices: Iterable[DeviceUse], profile: str, prec: str | None,
                  forbidden: AbstractSet[str]) -> DeviceUse | None:
        cands = [d for d in devices
                 if d.kind == "mig" and d.profile == profile and d.idle and d.uuid not in forbidden]
        if not cands:
            return None
        return min(cands, key=lambda d: (self._gpu_penalty(d.gpu_index, prec), d.shared,
                                         self._gpu_idle_fraction(d.gpu_index), d.gpu_index, d.uuid))

    def _pick_share(
        self, devices: Iterable[DeviceUse], fraction: float, mem: int, uid: int, prec: str | None,
        forbidden: AbstractSet[str], any_uid: bool = False,
    ) -> DeviceUse | None:
        best: DeviceUse | None = None
        best_key: tuple[object, ...] = ()
        for d in devices:
            if not d.shared or d.uuid in forbidden or not _share_fits(d, fraction, mem, uid, any_uid=any_uid):
                continue
            wrong = sum(1 for p in d.precs() if p != prec) if prec is not None else 0
            owner_miss = 1 if (d.mode == "mps" and not d.clients and d.mps_owner is not None
                               and d.mps_owner != uid) else 0
            # Other users' MPS servers on it: they time-slice with ours, so only when nothing better.
            strangers = 1 if d.mode == "mps" and d.strangers(uid) else 0
            key = (wrong, strangers, 1 if not d.clients else 0, owner_miss,
                   1 - d.used_fraction - fraction, d.memory_mib - d.used_mem - mem, d.gpu_index, d.uuid)
            if best is None or key < best_key:
                best, best_key = d, key
        return best


def _best_whole(free: list[DeviceUse], n: int) -> list[DeviceUse]:
    """n of the free whole GPUs (at least n): all on one NUMA node when one has enough."""
    nodes: dict[object, list[DeviceUse]] = {}
    for d in free:
        nodes.setdefault(d.numa, []).append(d)
    for devs in nodes.values():
        devs.sort(key=lambda d: (d.shared, d.gpu_index))  # exclusive-mode devices first
    fitting = [devs for devs in nodes.values() if len(devs) >= n]
    if fitting:
        # Best fit: the node with the fewest free GPUs that still has enough, then the fewest
        # share-mode devices taken, then the lowest index (stable).
        best = min(fitting, key=lambda devs: (len(devs), sum(d.shared for d in devs[:n]), devs[0].gpu_index))
        return best[:n]
    out: list[DeviceUse] = []
    for devs in sorted(nodes.values(), key=lambda ds: (-len(ds), ds[0].gpu_index)):
        out.extend(devs[: n - len(out)])
        if len(out) == n:
            break
    return out


_DEVICE_FIELDS = fields_of(AllocatedDevice)
_ALLOCATION_FIELDS = fields_of(Allocation)


def _alloc_dev(d: DeviceUse) -> AllocatedDevice:
    # construct: these values come from our own device table, and a pass proposes hundreds of
    # allocations (most never used), so pydantic validation was a tenth of the pass.
    return construct(AllocatedDevice, _DEVICE_FIELDS,
                     {"uuid": d.uuid, "gpu_index": d.gpu_index, "kind": d.kind, "profile": d.profile})


def _allocation(devices: list[AllocatedDevice], fraction: float, env: dict[str, str], *,
                share: float | None = None, gpu_mem_mib: int | None = None) -> Allocation:
    return construct(Allocation, _ALLOCATION_FIELDS, {"devices": devices, "compute_fraction": fraction,
                                                      "share": share, "gpu_mem_mib": gpu_mem_mib, "env": env})

