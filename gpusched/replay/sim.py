"""The replay event loop: a virtual clock, arrivals, completions, and actions applied to simulated GPUs.

It plays the daemon's engine without processes or sockets: it builds a `Snapshot`, calls the
policy's `plan(snapshot, now)`, and applies the actions the way docs/scheduling.md says the engine
must (in list order; after MIG changes or preemptions it plans again at once). MIG instances are
created and destroyed through the real `NvmlBackend` over `SimNVML`, so every layout obeys the
driver's placement rules and a busy instance cannot be destroyed (each job on a MIG instance is a
simulated process there). Jobs are `gpusched.model.Job`s with full histories, so `core.accounting`
measures replays exactly as it measures the daemon.

Time moves only from event to event. Policies whose decisions depend on elapsed time (MIG
hysteresis, preemption thresholds) get wake-up events exactly when those timers can expire, instead
of a periodic tick that would cost a plan per simulated minute over months of trace.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Sequence

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
from gpusched.gpu.backend import GpuError
from gpusched.gpu.simnvml import SimNVML
from gpusched.model import Job, JobState, MigRequest
from gpusched.replay.policies import Interference, PolicySetup
from gpusched.replay.sim_base import (
    ARRIVAL,
    END,
    EPS,
    MAX_ROUNDS,
    PID_BASE,
    READY,
    WAKE,
    Run,
    Segment,
    SimBase,
    SimResult,
)
from gpusched.replay.trace import TraceJob

__all__ = ["Segment", "SimResult", "Simulator", "run_policy"]


class Simulator(SimBase):
    """One policy over one trace. `run()` returns a SimResult; the object is single-use."""

    # ---- the loop --------------------------------------------------------------------------------
    def run(self) -> SimResult:
        began = time.perf_counter()
        for i, tj in enumerate(self.trace):
            self._push(tj.submit_s, ARRIVAL, i)
        start = self.trace[0].submit_s if self.trace else 0.0
        self.now = start
        self._mark()
        while self.events:
            t = self.events[0][0]
            self.now = t
            while self.events and self.events[0][0] <= t:
                _, kind, _, a, b = heapq.heappop(self.events)
                if kind == ARRIVAL:
                    self._arrive(a)
                elif kind == END:
                    self._end(a, b)
                elif kind == READY:
                    self._ready(a, b)
                else:
                    self.wakes.discard(t)
            self._plan()
        end = max((j.ended_at for j in self.jobs.values() if j.ended_at is not None), default=start)
        for jid, run in list(self.runs.items()):  # only if something could never finish
            self._close_segment(run)
            del self.runs[jid]
        return SimResult(
            policy=self.policy.name, node=self.policy.node.description, jobs=list(self.jobs.values()),
            segments=self.segments, capacity_gpus=float(len(self.gpus)), plan_us=self.plan_us,
            mig_reconfigurations=self.reconfigs, mig_errors=self.mig_errors, unsatisfiable=self.unsatisfiable,
            stuck=len(self.pending), start=start, end=end, wall_s=time.perf_counter() - began, timeline=self.timeline,
            requested=self.requested, expected=self.expected)

    def _arrive(self, index: int) -> None:
        tj = self.trace[index]
        jid = index + 1
        job = self._make_job(jid, tj)
        self.jobs[jid] = job
        self.pending[jid] = job
        self.durations[jid] = tj.duration_s
        self.requested[jid] = tj.gpu_demand * tj.duration_s
        if self.queue is not None:
            self.queue.submit(job)

    def _snapshot(self) -> Snapshot:
        pending = () if self.queue is not None else tuple(self.pending.values())
        return Snapshot(gpus=self.gpus, pending=pending, active=tuple(self.active.values()),
                        share_modes=self.share_modes, dynamic=self.policy.node.dynamic,
                        checkpoint=self.policy.node.checkpoint, checkpoint_moves=self.policy.node.checkpoint,
                        yielded=frozenset(self.yielded))

    def _plan(self) -> None:
        for _ in range(MAX_ROUNDS):
            if not self.pending and not isinstance(self.planner, Scheduler):
                break
            snap = self._snapshot()
            t0 = time.perf_counter()
            actions = self.planner.plan(snap, self.now)
            self.plan_us.append((time.perf_counter() - t0) * 1e6)
            again = False
            changed = False
            for action in actions:
                if isinstance(action, (CreateInstance, DestroyInstance, SetMigMode)):
                    changed |= self._mig(action)
                    again = True
                elif isinstance(action, PreemptJob):
                    self._preempt(action)
                    again = True
                else:
                    self._apply(action)
            if changed:
                self.gpus = self.backend.inventory().gpus
            if not again:
                break
        self._schedule_wakes()
        self._mark()

    def _mark(self) -> None:
        """Record total allocated GPUs for the utilization-over-time plot (only when it changed)."""
        if not self.timeline or abs(self.timeline[-1][1] - self.allocated) > 1e-9:
            self.timeline.append((self.now, self.allocated))

    # ---- actions ---------------------------------------------------------------------------------
    def _apply(self, action: Action) -> None:
        if isinstance(action, StartJob):
            self._start(action)
        elif isinstance(action, FailJob):
            job = self.pending.pop(action.job_id, None)
            if job is not None:
                self._set(job, JobState.FAILED, action.reason, ended_at=self.now)
                self.unsatisfiable += 1
        elif isinstance(action, ResumeJob):
            self._resume(action)
        # SetPartitionMode: the simulated node has no partitions (traces have no --partition jobs), so the
        # scheduler never asks for one here (docs/replay.md)

    def _start(self, action: StartJob) -> None:
        job = self.pending.pop(action.job_id, None)
        if job is None:
            return
        alloc = action.allocation
        restore = self.inter.checkpoint_restore_s if job.id in self.restoring else 0.0
        self.restoring.discard(job.id)
        if action.expected_s is not None:
            self.expected[job.id] = action.expected_s
        job = self._set(job, JobState.STARTING, action.reason, allocation=alloc, started_at=self.now)
        ready = max([self.ready_at.get(u, self.now) for u in alloc.uuids] + [self.now]) + restore
        limit = job.spec.time_limit_s
        run = Run(job.id, self.durations[job.id], self.now + limit if limit else math.inf, ready, self.now,
                   frac=alloc.compute_fraction, seg_start=self.now)
        mig = [d.uuid for d in alloc.devices if d.kind == "mig"]
        if mig and isinstance(self.sim, SimNVML):  # (MIG exists only on NVIDIA)
            run.pid = PID_BASE + job.id
            self.sim.add_process(mig[0], run.pid, None)
            for u in mig:
                self.idle_since.pop(u, None)
        run.groups, run.dyn_frac = self._groups_of(job, alloc)
        if ready <= self.now:
            job = self._set(job, JobState.RUNNING, "started")
        else:
            self._push(ready, READY, job.id)
        self.active[job.id] = job
        self.runs[job.id] = run
        self.segments.setdefault(job.id, [])
        self.allocated += run.frac
        for g in run.groups:
            self.groups.setdefault(g, set()).add(job.id)
        self._regroup(run.groups, also=run)

    def _ready(self, jid: int, _: int) -> None:
        job = self.active.get(jid)
        if job is not None and job.state is JobState.STARTING:
            self.active[jid] = self._set(job, JobState.RUNNING, "MIG instance ready")

    def _mig(self, action: CreateInstance | DestroyInstance | SetMigMode) -> bool:
        """Apply a MIG change through NVML (simulated); the GPU's changed slices are busy meanwhile."""
        try:
            if isinstance(action, SetMigMode):
                g = action.gpu_index
                change = self.backend.set_mig_mode(g, action.enabled)
                if change.pending or change.current != action.enabled:
                    raise GpuError(f"MIG mode of GPU {g} did not change: {change.detail}")
                done = max(self.busy_until.get(g, self.now), self.now) + self.inter.mig_mode_s
                gpu_uuid = next(gpu.uuid for gpu in self.gpus if gpu.index == g)
                self.ready_at[gpu_uuid] = done  # a whole GPU is usable once the switch is over
            elif isinstance(action, CreateInstance):
                inst = self.backend.create_instance(action.gpu_index, action.profile, action.start)
                g = action.gpu_index
                done = max(self.busy_until.get(g, self.now), self.now) + self.inter.mig_create_s
                self.ready_at[inst.uuid] = done
                self.idle_since[inst.uuid] = self.now
            else:
                g = next((gpu.index for gpu in self.gpus for i in gpu.instances if i.uuid == action.uuid), -1)
                self.backend.destroy_instance(action.uuid)
                done = max(self.busy_until.get(g, self.now), self.now) + self.inter.mig_destroy_s
                self.ready_at.pop(action.uuid, None)
                self.idle_since.pop(action.uuid, None)
        except GpuError as exc:
            self.mig_errors.append(f"t={self.now:.0f}: {action}: {exc.message}")
            return False
        self.busy_until[g] = done
        self.last_change[g] = self.now
        self.reconfigs += 1
        return True

    def _preempt(self, action: PreemptJob) -> None:
        job = self.active.get(action.job_id)
        if job is None or (action.mode == "requeue" and not job.spec.requeue):
            return
        if action.mode == "suspend":
            self._suspend(job, action.reason)
            return
        run = self.runs[job.id]
        self._release(job.id)
        if action.mode == "checkpoint":  # its progress is kept; it pays the restore when it resumes
            self.durations[job.id] = run.work_left
            self.restoring.add(job.id)
        else:
            self.durations[job.id] = self.trace[job.id - 1].duration_s
        job = self._set(job, JobState.PREEMPTED, action.reason, ended_at=self.now)
        job = self._set(job, JobState.PENDING, "requeued after preemption", allocation=None, started_at=None,
                        ended_at=None)
        self.pending[job.id] = job
        if self.queue is not None:
            self.queue.submit(job)

    def _suspend(self, job: Job, reason: str) -> None:
        """SIGSTOP in place: no progress and no compute (its co-residents speed up), memory kept."""
        run = self.runs[job.id]
        self._advance(run)
        self._close_segment(run)
        self.allocated -= run.frac
        run.frac = 0.0
        run.version += 1  # its pending end event is void
        for g in run.groups:
            self.groups[g].discard(job.id)
        self._regroup(run.groups)
        self.active[job.id] = self._set(job, JobState.SUSPENDED, reason)
        self.yielded.add(job.id)

    def _resume(self, action: ResumeJob) -> None:
        job = self.active.get(action.job_id)
        if job is None or action.job_id not in self.yielded:
            return
        self.yielded.discard(job.id)
        run = self.runs[job.id]
        run.since = run.seg_start = self.now
        if not run.dyn_frac and job.allocation is not None:  # it holds its share again (suspend set 0)
            run.frac = job.allocation.compute_fraction
            self.allocated += run.frac
        for g in run.groups:
            self.groups.setdefault(g, set()).add(job.id)
        self.active[job.id] = self._set(job, JobState.RUNNING, action.reason)
        self._regroup(run.groups, also=run)

    def _end(self, jid: int, version: int) -> None:
        run = self.runs.get(jid)
        if run is None or run.version != version:
            return
        self._advance(run)
        timeout = run.work_left > 1e-6 and self.now >= run.deadline - EPS
        if not timeout and run.work_left > 1e-6:  # float slack: finish the last sliver
            finish = self.now + run.work_left / run.speed
            if finish - self.now > 1e-6:
                run.version += 1
                self._push(finish, END, jid, run.version)
                return
        job = self._release(jid)
        if timeout:
            job = self._set(job, JobState.TIMEOUT, "time limit reached", ended_at=self.now)
        else:
            job = self._set(job, JobState.COMPLETED, "exited 0", ended_at=self.now, exit_code=0)
        if self.learner is not None:
            self.learner.observe_end(job)

    # ---- timers ----------------------------------------------------------------------------------
    def _schedule_wakes(self) -> None:
        """Wake the scheduler when a timer it waits on can expire (nothing else would call plan)."""
        if not isinstance(self.planner, Scheduler) or not self.pending:
            return
        cfg = self.planner.config
        times: list[float] = []
        if self.policy.node.dynamic and any(isinstance(j.spec.request, MigRequest) for j in self.pending.values()):
            times += [t + cfg.mig.min_idle_s for t in self.idle_since.values()]
            times += [t + cfg.mig.min_reconfig_interval_s for t in self.last_change.values()]
        if self.policy.node.dynamic and cfg.mig.toggle_mode:
            # An idle dynamic GPU may switch MIG mode once idle min_idle_s (and reconfigured long
            # enough ago): wake then, or a blocked job could wait for an event that never comes.
            held = {d.gpu_index for j in self.active.values() if j.allocation for d in j.allocation.devices}
            if any(g not in held for g in self.policy.node.dynamic):
                times.append(self.now + cfg.mig.min_idle_s)
                times += [t + cfg.mig.min_reconfig_interval_s for t in self.last_change.values()]
        if cfg.preempt_after_s is not None and any(j.spec.requeue for j in self.active.values()):
            times += [self._pending_since(j) + cfg.preempt_after_s for j in self.pending.values()]
            times += [j.started_at + cfg.preempt_min_run_s for j in self.active.values()
                      if j.spec.requeue and j.started_at is not None]
        for t in times:
            t += 1e-3
            if t > self.now and t not in self.wakes:
                self.wakes.add(t)
                self._push(t, WAKE)

    @staticmethod
    def _pending_since(job: Job) -> float:
        return job.history[-1].at if job.history else job.submitted_at


def run_policy(policy: PolicySetup, jobs: Sequence[TraceJob], interference: Interference) -> SimResult:
    """Replay `jobs` under `policy` and return what happened."""
    return Simulator(policy, jobs, interference).run()
