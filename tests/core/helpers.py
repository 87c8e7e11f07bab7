"""Factories and a tiny virtual-clock node for core tests: GPUs, instances, jobs, and an engine stand-in.

`Node` applies actions the way the engine contract says (destroys, creates, starts, preemptions),
ends jobs at their duration, and calls plan on every event, so tests can run hours of simulated time.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field, replace

from gpusched.core.migplan import layout_violations, slot_of
from gpusched.core.scheduler import (
    Action,
    CreateInstance,
    DestroyInstance,
    FailJob,
    PreemptJob,
    ResumeJob,
    Scheduler,
    SetMigMode,
    Snapshot,
    StartJob,
)
from gpusched.gpu.backend import Gpu, Instance
from gpusched.gpu.profiles import get_model, profile_by_name
from gpusched.model import Job, JobSpec, JobState, MigRequest, ShareRequest, WholeRequest

_ids = itertools.count(1)


def gpu(index: int, model: str = "H100-80GB", *, mig: bool = False, instances: tuple[Instance, ...] = (),
        numa: int | None = None) -> Gpu:
    m = get_model(model)
    return Gpu(index=index, uuid=f"GPU-{index:04d}", name=m.driver_name, model=model,
               memory_total_mib=m.memory_mib, sm_count=m.sm_count, mig_enabled=mig, mig_pending=mig,
               instances=instances, numa_node=numa)


def instance(gpu_index: int, profile: str, start: int, model: str = "H100-80GB", uuid: str | None = None) -> Instance:
    p = profile_by_name(model, profile)
    return Instance(uuid=uuid or f"MIG-{gpu_index}-{profile}-{start}-{next(_ids)}", gpu_index=gpu_index,
                    profile=profile, profile_id=p.profile_id, gi_id=start + 1, ci_id=0, start=start,
                    size=p.memory_slices, memory_mib=p.memory_mib, sm_count=p.sm_count)


def job(jid: int, user: str = "alice", *, uid: int | None = None, gpus: int | None = None, mig: str | None = None,
        share: float | None = None, mem: int = 1024, submitted: float = 0.0, time_limit: float | None = None,
        job_class: str = "batch", nice: int = 0, requeue: bool = False, precision: str | None = None) -> Job:
    if mig is not None:
        req: WholeRequest | MigRequest | ShareRequest = MigRequest(profile=mig)
    elif share is not None:
        req = ShareRequest(fraction=share, gpu_mem_mib=mem)
    else:
        req = WholeRequest(gpus=gpus or 1)
    spec = JobSpec(argv=["train"], cwd="/tmp", request=req, time_limit_s=time_limit,
                   job_class=job_class, nice=nice, requeue=requeue, precision=precision)  # type: ignore[arg-type]
    return Job(id=jid, uid=uid if uid is not None else 1000 + sum(map(ord, user)), gid=100, user=user,
               spec=spec, state=JobState.PENDING, submitted_at=submitted)


@dataclass
class Node:
    """The engine in miniature: owns GPUs and jobs, applies actions, runs a virtual clock."""

    sched: Scheduler
    gpus: list[Gpu]
    share_modes: dict[str, str] = field(default_factory=dict)
    dynamic: frozenset[int] = frozenset()
    now: float = 0.0
    pending: dict[int, Job] = field(default_factory=dict)
    active: dict[int, Job] = field(default_factory=dict)
    duration: dict[int, float] = field(default_factory=dict)
    events: list[tuple[float, int, int]] = field(default_factory=list)  # (time, seq, job id)
    done: dict[int, Job] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)
    service: dict[str, float] = field(default_factory=dict)  # GPU-seconds actually delivered
    actions: list[Action] = field(default_factory=list)
    seq: itertools.count = field(default_factory=itertools.count)  # type: ignore[type-arg]
    tick: float = 60.0
    ends: dict[int, float] = field(default_factory=dict)  # running job -> when it ends
    left: dict[int, float] = field(default_factory=dict)  # share suspended in place -> work left
    yielded: set[int] = field(default_factory=set)
    _gpus: tuple[Gpu, ...] | None = None

    def submit(self, j: Job, duration: float) -> None:
        self.pending[j.id] = j.model_copy(update={"submitted_at": self.now})
        self.duration[j.id] = duration
        if self.sched.incremental:
            self.sched.submit(self.pending[j.id])

    def snapshot(self) -> Snapshot:
        # the same tuple while the GPUs are the same objects, as the engine does (the scheduler then
        # keeps its placement view instead of rebuilding it)
        if self._gpus is None or len(self._gpus) != len(self.gpus) or any(
                a is not b for a, b in zip(self._gpus, self.gpus, strict=True)):
            self._gpus = tuple(self.gpus)
        return Snapshot(gpus=self._gpus, pending=tuple(self.pending.values()),
                        active=tuple(self.active.values()), share_modes=self.share_modes, dynamic=self.dynamic,
                        yielded=frozenset(self.yielded))

    def step(self) -> list[Action]:
        """One plan, applied; re-plan at once after MIG changes or preemptions, as the engine does."""
        out: list[Action] = []
        for _ in range(5):
            acts = self.sched.plan(self.snapshot(), self.now)
            self.actions.extend(acts)
            out.extend(acts)
            for a in acts:
                self.apply(a)
            if not any(isinstance(a, (CreateInstance, DestroyInstance, SetMigMode, PreemptJob)) for a in acts):
                break
        return out

    def apply(self, a: Action) -> None:
        if isinstance(a, StartJob):
            j = self.pending.pop(a.job_id)
            started = j.model_copy(update={"state": JobState.RUNNING, "started_at": self.now,
                                           "allocation": a.allocation})
            self.active[j.id] = started
            self.ends[j.id] = self.now + self.duration[j.id]
            heapq.heappush(self.events, (self.ends[j.id], next(self.seq), j.id))
        elif isinstance(a, FailJob):
            self.pending.pop(a.job_id, None)
            self.failed[a.job_id] = a.reason
        elif isinstance(a, PreemptJob) and a.mode == "suspend":  # SIGSTOP in place: no progress, memory kept
            j = self.active[a.job_id]
            assert j.allocation is not None and j.allocation.share is not None, "only shares are suspended"
            self._account(j)
            self.left[j.id] = self.ends.pop(j.id) - self.now
            self.active[j.id] = j.model_copy(update={"state": JobState.SUSPENDED})
            self.yielded.add(j.id)
        elif isinstance(a, ResumeJob):
            assert a.job_id in self.yielded, f"resumed job {a.job_id}, which was not suspended in place"
            self.yielded.discard(a.job_id)
            j = self.active[a.job_id]
            self.active[j.id] = j.model_copy(update={"state": JobState.RUNNING, "started_at": self.now})
            self.ends[j.id] = self.now + self.left.pop(j.id)
            heapq.heappush(self.events, (self.ends[j.id], next(self.seq), j.id))
        elif isinstance(a, PreemptJob):
            j = self.active.pop(a.job_id)
            self.ends.pop(j.id, None)
            self._account(j)
            self.pending[j.id] = j.model_copy(update={"state": JobState.PENDING, "allocation": None,
                                                      "started_at": None})
            if self.sched.incremental:
                self.sched.submit(self.pending[j.id])
        elif isinstance(a, DestroyInstance):
            for i, g in enumerate(self.gpus):
                if any(x.uuid == a.uuid for x in g.instances):
                    busy = {u for jb in self.active.values() if jb.allocation for u in jb.allocation.uuids}
                    assert a.uuid not in busy, f"destroyed busy instance {a.uuid}"
                    self.gpus[i] = replace(g, instances=tuple(x for x in g.instances if x.uuid != a.uuid))
        elif isinstance(a, SetMigMode):
            i = next(k for k, g in enumerate(self.gpus) if g.index == a.gpu_index)
            g = self.gpus[i]
            busy = {u for jb in self.active.values() if jb.allocation for u in jb.allocation.uuids}
            assert g.uuid not in busy and not g.instances, f"MIG mode of GPU {g.index} changed while in use"
            self.gpus[i] = replace(g, mig_enabled=a.enabled, mig_pending=a.enabled)
        elif isinstance(a, CreateInstance):
            i = next(k for k, g in enumerate(self.gpus) if g.index == a.gpu_index)
            g = self.gpus[i]
            new = instance(g.index, a.profile, a.start, g.model)
            bad = layout_violations(g.model, [slot_of(x, g.model) for x in (*g.instances, new)])
            assert not bad, bad
            self.gpus[i] = replace(g, instances=(*g.instances, new))

    def _account(self, j: Job) -> None:
        assert j.allocation is not None and j.started_at is not None
        self.service[j.user] = self.service.get(j.user, 0.0) + j.allocation.compute_fraction * (
            self.now - j.started_at)

    def run_until(self, t_end: float, on_tick: object = None) -> None:
        """Advance the clock event by event (job ends), planning after each, until t_end."""
        self.step()
        while True:
            nxt = self.events[0][0] if self.events else float("inf")
            if self.pending and self.now + self.tick < nxt:  # the daemon's periodic tick
                if self.now + self.tick > t_end:
                    break
                self.now += self.tick
                self.step()
                continue
            if nxt > t_end:
                break
            t, _, jid = heapq.heappop(self.events)
            if jid not in self.active or self.ends.get(jid) != t:
                continue  # preempted or suspended earlier
            self.now = t
            j = self.active.pop(jid)
            del self.ends[jid]
            self._account(j)
            self.done[jid] = j
            if callable(on_tick):
                on_tick(self)
            self.step()
        self.now = t_end

    def service_until_now(self) -> dict[str, float]:
        out = dict(self.service)
        for j in self.active.values():
            if j.state is JobState.SUSPENDED:
                continue
            assert j.allocation is not None and j.started_at is not None
            out[j.user] = out.get(j.user, 0.0) + j.allocation.compute_fraction * (self.now - j.started_at)
        return out
