"""The engine's shared state and its bookkeeping: every job transition (`_set`), the queues' mirrors,
stopping running jobs, waking the loop.

The other parts of the engine (requests, devices, preemption, recovery) are mixins over this class;
engine.py composes them with the pass. Nothing here decides anything: it records and carries out.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from collections.abc import Callable, Coroutine
from typing import Any, cast

from gpusched.config import DaemonConfig
from gpusched.daemon.arrays import Arrays
from gpusched.daemon.cgroups import CgroupManager
from gpusched.daemon.checkpointing import Checkpoints
from gpusched.daemon.counters import Metrics
from gpusched.daemon.devices import DeviceManager
from gpusched.daemon.executor import Executor
from gpusched.daemon.groupcommit import GroupCommit
from gpusched.daemon.jobmap import job_mapping, write_job_mapping
from gpusched.daemon.launch import Launcher
from gpusched.daemon.recovery import StopRequest, path_to
from gpusched.daemon.store import Store
from gpusched.gpu.backend import Gpu, GpuBackend, Inventory
from gpusched.model import (
    ACTIVE_STATES,
    TERMINAL_STATES,
    WAITING_STATES,
    Dependency,
    Job,
    JobState,
    run_seconds,
)
from gpusched.policy import Incremental, LearnsRunTimes, Policy, is_incremental

log = logging.getLogger("gpusched.engine")
# How an array whose tasks have all ended counts for --after: its first state in this order among its tasks'.
_ARRAY_OUTCOME_ORDER = (JobState.FAILED, JobState.TIMEOUT, JobState.LOST, JobState.CANCELLED, JobState.COMPLETED)


class EngineCore:
    """The engine's state and the primitives every part of it uses."""

    # Set by Engine.__init__ (engine.py); declared here so every part of the engine is typed alike.
    config: DaemonConfig
    store: Store
    backend: GpuBackend
    executor: Executor
    scheduler: Policy  # the built-in fair-share Scheduler, or a site's plug-in (gpusched/policy.py)
    clock: Callable[[], float]
    cgroups: CgroupManager | None
    cgroup_note: str
    metrics: Metrics
    devices: DeviceManager
    launcher: Launcher
    checkpoints: Checkpoints
    _batch_log: dict[int, tuple[Job, Job]] | None  # inside `batch()`: job id -> (before it, now)
    jobs: dict[int, Job]
    inventory: Inventory
    last_seen: dict[int, Gpu]
    layouts_pending: set[int]
    ended_unsaved: bool
    _run_anchors: dict[int, tuple[int, float, float]]
    scheduler_gpus: tuple[Gpu, ...]  # inventory.gpus, kept as the same object while placement sees no change
    _share_modes: tuple[tuple[Gpu, ...], DaemonConfig, dict[str, str]] | None  # share_modes() and its sources
    _dynamic_gpus: tuple[DaemonConfig, frozenset[int]] | None
    arrays: Arrays
    commits: GroupCommit
    passes: int
    shutting_down: bool
    _yielded: set[int]
    _history_saved_at: float
    _wake: asyncio.Event
    _changed: asyncio.Condition
    _notify_pending: bool
    _stops: dict[int, StopRequest]
    _final_states: dict[int, JobState]
    _active: dict[int, None]
    _waiting_by_uid: dict[int, int]
    _waiting_bytes_by_uid: dict[int, int]
    _submit_tokens: dict[int, tuple[float, float]]
    _awaiting_deps: set[int]
    _held_with_deps: set[int]
    _kill_timers: dict[int, asyncio.TimerHandle]
    _requests: dict[tuple[int, str], asyncio.Future[tuple[int | None, list[Job]]]]
    _handing: set[int]
    _tasks: set[asyncio.Task[None]]
    _gpu_state_moves: set[asyncio.Task[None]]  # checkpoints and restores under way
    _loop_task: asyncio.Task[None] | None

    def wake(self) -> None:
        self._wake.set()

    def get(self, job_id: int) -> Job | None:
        return self.jobs.get(job_id) or self.store.get(job_id)

    def active_jobs(self) -> list[Job]:
        """STARTING / RUNNING / SUSPENDED jobs, from the index (never a scan of the whole queue)."""
        return [self.jobs[i] for i in sorted(self._active) if i in self.jobs]

    @property
    def _incremental(self) -> bool:
        return is_incremental(self.scheduler)

    @property
    def _queue(self) -> Incremental | None:
        """The policy when it keeps its own queue (told of every job that becomes pending or leaves
        it), else None: then the snapshot shows it the pending jobs. A cast, not an isinstance: this is
        asked on every state change, and gpusched/policies.py checked submit and remove at load."""
        return cast(Incremental, self.scheduler) if is_incremental(self.scheduler) else None

    def share_modes(self) -> dict[str, str]:
        """Device UUID -> mps | timeslice for GPUs (and their MIG instances) configured to be shared.

        The same dict while the GPUs (as placement sees them) and the config are the same objects:
        every submit and every pass asks, and the scheduler skips its shape check for an unchanged
        object. Callers must not modify it."""
        gpus, config = self.scheduler_gpus, self.config
        cached = self._share_modes
        if cached is not None and cached[0] is gpus and cached[1] is config:
            return cached[2]
        modes: dict[str, str] = {}
        for gpu in gpus:
            gpu_config = config.gpus.get(str(gpu.index))
            if gpu_config is not None and gpu_config.share != "exclusive":
                modes[gpu.uuid] = gpu_config.share
                modes.update((i.uuid, gpu_config.share) for i in gpu.instances)
        self._share_modes = (gpus, config, modes)
        return modes

    def dynamic_gpus(self) -> frozenset[int]:
        config = self.config
        cached = self._dynamic_gpus
        if cached is not None and cached[0] is config:
            return cached[1]
        dynamic = frozenset(int(k) for k, g in config.gpus.items() if g.mig == "dynamic")
        self._dynamic_gpus = (config, dynamic)
        return dynamic

    def _dependency_status(self, dep: Dependency) -> bool | None:
        """True when met, False when it can never be met, None while the other job has not ended.

        `--after ARRAY_ID` waits for every task of the array: met with `any` once all have ended,
        with `ok` once all have COMPLETED; an array is ended when none of its tasks is left unfinished."""
        other = self.jobs.get(dep.job_id)
        if other is not None or dep.job_id in self.arrays.by_id:
            return None  # unfinished jobs live in self.jobs, arrays with unfinished tasks in self.arrays
        final = self._final_states.get(dep.job_id)
        if final is None:
            ended = self.store.owner(dep.job_id)
            if ended is not None:
                final = ended[2]
            else:
                counts = self.store.array_counts([dep.job_id]).get(dep.job_id)
                if not counts:
                    return False  # no such job or array (any more)
                states = {JobState(s) for s in counts}
                if not states <= TERMINAL_STATES:
                    return None
                # The array's outcome: COMPLETED only if every task completed, else its worst task's end.
                final = min(states, key=_ARRAY_OUTCOME_ORDER.index)
            self._final_states[dep.job_id] = final
        return dep.condition == "any" or final is JobState.COMPLETED

    def _dependency_name(self, dep: Dependency) -> str:
        """`job 12`, or `array 120` for an --after on a job array (its tasks are jobs of their own)."""
        is_array = dep.job_id in self.arrays.by_id or (
            dep.job_id not in self.jobs and self.store.owner(dep.job_id) is None
            and dep.job_id in self.store.arrays([dep.job_id]))
        return f"array {dep.job_id}" if is_array else f"job {dep.job_id}"

    def _enqueue(self, job: Job, batch: list[Job] | None = None) -> None:
        """A job became PENDING: the scheduler gets it once its dependencies are met (and, for a task of
        an array with %MAX, once fewer than MAX of its array's tasks are queued or running). With
        `batch`, a ready job is added to it instead, for the caller to hand over with the others."""
        queue = self._queue
        # (a job of no array is always admitted: a restart asks this of every queued job)
        if (job.array_id is not None and not self.arrays.admit(job)) or queue is None:
            return
        if self._ready(job):
            self._awaiting_deps.discard(job.id)
            if batch is None:
                queue.submit(job)
            else:
                batch.append(job)
        else:
            self._awaiting_deps.add(job.id)

    def _ready(self, job: Job) -> bool:
        after = job.spec.after  # (most jobs have none: a restart asks this of every queued one)
        return not after or all(self._dependency_status(d) for d in after)

    def _release_met_dependencies(self) -> None:
        for job_id in sorted(self._awaiting_deps):
            job = self.jobs.get(job_id)
            if job is None or job.state is not JobState.PENDING:
                self._awaiting_deps.discard(job_id)
            elif self._ready(job):
                self._enqueue(job)

    def _fail_broken_dependencies(self) -> None:
        waiting = [self.jobs[i] for i in sorted(self._awaiting_deps) if i in self.jobs]
        held = [self.jobs[i] for i in sorted(self._held_with_deps) if i in self.jobs]
        for job in waiting + held + self._capped_behind_deps() if self._incremental else list(self.jobs.values()):
            if job.state not in (JobState.PENDING, JobState.HELD):
                continue
            for dep in job.spec.after:
                if self._dependency_status(dep) is False:
                    final = self._final_states.get(dep.job_id, "unknown")
                    self._set(job, JobState.FAILED, f"dependency can never be met: {self._dependency_name(dep)} "
                              f"ended {final}, needed COMPLETED", ended_at=self.clock())
                    break

    def _capped_behind_deps(self) -> list[Job]:
        """Tasks that %MAX holds back, of arrays whose dependency can never be met: they fail with
        the rest (checked once per array: its tasks share one spec). Else only the MAX admitted ones
        failed per pass, and a 10,000-task `%1` array took hours to fail."""
        found: list[Job] = []
        for info in self.arrays.by_id.values():
            tasks = [self.jobs[i] for i in sorted(info.waiting) if i in self.jobs]
            if tasks and any(self._dependency_status(dep) is False for dep in tasks[0].spec.after):
                found += tasks
        return found

    def _request_stop(self, job: Job, stop: StopRequest) -> None:
        """SIGTERM the job's process group now, SIGKILL after the grace period."""
        if job.id in self._kill_timers:
            under_way = self._stops.get(job.id)
            if under_way is not None and under_way.final is JobState.PREEMPTED and stop.final is JobState.CANCELLED:
                # A cancel wins over a requeue already under way (a preemption, a drained GPU): the
                # owner wants the job gone, and it would come back. The signals sent stand.
                self._stops[job.id] = stop
                self._persist_stops()
            return
        self._stops[job.id] = stop
        self._persist_stops()
        self._signal_stop(job)

    def _signal_stop(self, job: Job) -> None:
        """Carry out a recorded stop once the job has a pid (a STARTING job gets it when it runs)."""
        if job.pid and job.id not in self._kill_timers:
            if job.state in (JobState.SUSPENDED, JobState.STARTING):
                # A stopped job cannot handle SIGTERM (one stopped by its user before its exec neither).
                self.executor.signal(job.pid, signal.SIGCONT)
            self.executor.signal(job.pid, signal.SIGTERM)
            loop = asyncio.get_running_loop()
            self._kill_timers[job.id] = loop.call_later(self.config.kill_grace_s, self._kill_hard, job.id, job.pid)

    def _kill_hard(self, job_id: int, pid: int) -> None:
        """The grace period is over: SIGKILL the process group, and the cgroup for anything that escaped it."""
        self.executor.signal(pid, signal.SIGKILL)
        if self.cgroups is not None:
            self.cgroups.kill(job_id)

    def _persist_stops(self) -> None:
        self.store.set_meta(
            "stop_requests", json.dumps({str(k): [v.final.value, v.reason] for k, v in self._stops.items()})
        )

    def _end(self, job: Job, final: JobState, reason: str, **fields: Any) -> Job:
        """Move a job to `final` by legal steps (a STARTING job that ran passes through RUNNING)."""
        if job.state in TERMINAL_STATES:
            return job
        steps = path_to(job.state, final)
        for state in steps[:-1]:
            job = self._set(job, state, "ran (recorded after the fact)")
        if steps[-1] is not final:
            reason = f"{reason} (ended {steps[-1]}: no way from {job.state} to {final})"
        return self._set(job, steps[-1], reason, **fields)

    def _cleanup(self, job_id: int, ended: Job | None = None) -> None:
        """Forget a job's stop request and timers, and give back its MPS share and cgroup.

        Call it after the job's end is committed (`ended`: the job as it was before), never before:
        the stop request says why it ended (cancelled, its time limit), and a crash between erasing
        it and recording the end would leave a job that the next start finds dead with no reason,
        and ends FAILED."""
        job = ended if ended is not None else self.jobs.get(job_id)
        if job is not None:
            for uuid in self.launcher.idle_mps(job, self.active_jobs()):
                # (a later share restarts it; one starting meanwhile keeps it: _mps_still_idle)
                self._spawn(self.launcher.stop_mps(uuid, job.uid, self._mps_still_idle(uuid, job.uid, job.id)))
            for uuid, uid in self.launcher.mps_ended(job):  # the user's other shares there: caps down to them
                self._spawn(self.launcher.update_mps_caps(uuid, uid))
        self._run_anchors.pop(job_id, None)
        self.ended_unsaved = True
        timer = self._kill_timers.pop(job_id, None)
        if timer is not None:
            timer.cancel()
        if self._stops.pop(job_id, None) is not None:
            self._persist_stops()
        if self.cgroups is not None:
            self.cgroups.kill(job_id)  # anything that left the job's session still dies with the job
            if not self.cgroups.remove(job_id):
                log.warning("job %d: cgroup %s still has processes; left in place", job_id,
                            self.cgroups.job_path(job_id))

    def _mps_still_idle(self, uuid: str, uid: int, ended: int) -> Callable[[], bool]:
        """Asked from the stop's worker thread, with that control daemon's starts held off: does no
        share of `uid` on `uuid` run, or start, now? (a tuple of the ids: the loop may change the dict)"""
        def idle() -> bool:
            if self.launcher.mps_starting.get((uuid, uid)):
                return False
            jobs = [self.jobs.get(i) for i in tuple(self._active) if i != ended]
            return not any(j is not None and j.uid == uid and j.allocation is not None and uuid in j.allocation.uuids
                           for j in jobs)
        return idle

    def _set(self, job: Job, state: JobState, reason: str, *, at: float | None = None, **fields: object) -> Job:
        """Commit a transition (at `at`, for one that happened earlier than now), then keep every index current."""
        updated = self.store.transition(job, state, now=self.clock() if at is None else at, reason=reason, **fields)
        if self._batch_log is not None:
            first = self._batch_log.get(job.id)
            self._batch_log[job.id] = (first[0] if first is not None else job, updated)
        log.info("job %d: %s -> %s (%s)", job.id, job.state, state, reason)
        if state is JobState.RUNNING:  # its time limit counts on the monotonic clock from here (engine_recovery)
            self._run_anchors[job.id] = (len(updated.history), time.monotonic(),
                                         run_seconds(updated, updated.history[-1].at))
        self._follow(job, updated)
        return updated

    def _follow(self, job: Job, updated: Job) -> None:
        """Every index follows `job` becoming `updated`: a committed change, or one undone (`_revert`)."""
        state = updated.state
        self._handing.discard(job.id)  # whatever its state now, this change decides what the scheduler gets
        if state in TERMINAL_STATES:
            self.jobs.pop(job.id, None)
            if isinstance(self.scheduler, LearnsRunTimes):
                if job.state in ACTIVE_STATES:
                    self.scheduler.observe_end(updated)  # its run time teaches the estimates (core/estimate.py)
                self.scheduler.forget_ended(job.id)  # nothing of it is kept (its preemption count)
        else:
            self.jobs[job.id] = updated
        if state in ACTIVE_STATES:
            self._active.setdefault(job.id)  # a job already active keeps its place
        else:
            self._active.pop(job.id, None)
        if state is JobState.HELD and job.spec.after:
            self._held_with_deps.add(job.id)
        else:
            self._held_with_deps.discard(job.id)
        if (state in WAITING_STATES) != (job.state in WAITING_STATES):
            self._count_waiting(job, 1 if state in WAITING_STATES else -1)
        if state is JobState.PENDING and job.state is not JobState.PENDING:
            self._enqueue(updated)  # submitted, released, or requeued after preemption
        elif job.state is JobState.PENDING and state is not JobState.STARTING and (queue := self._queue) is not None:
            self._awaiting_deps.discard(job.id)
            queue.remove(job.id)  # cancelled, held or failed: StartJob already dequeued it
        if job.id in self._yielded and state is not JobState.SUSPENDED:
            self._set_yielded(job.id, False)  # resumed, continued by a signal, or ended
        if state in TERMINAL_STATES and job.id in self.checkpoints.saved:
            self.checkpoints.forget(job.id)
            if (queue := self._queue) is not None:
                queue.remove(job.id)  # ended while checkpointed (cancelled, killed): no restore
        if (job.state in ACTIVE_STATES) != (state in ACTIVE_STATES):
            self._write_job_mapping()
        if job.array_id is not None and (state in TERMINAL_STATES or state is JobState.HELD):
            for freed in self.arrays.leave(updated, ended=state in TERMINAL_STATES):  # %MAX: the next task may go
                if freed in self.jobs:
                    self._enqueue(self.jobs[freed])
        self._notify()

    def _set_yielded(self, job_id: int, on: bool) -> None:
        if on == (job_id in self._yielded):
            return
        if on:
            self._yielded.add(job_id)
        else:
            self._yielded.discard(job_id)
        self.store.set_meta("yielded", json.dumps(sorted(self._yielded)))

    def _count_waiting(self, job: Job, delta: int) -> None:
        held = self.arrays.held_bytes(job)  # an array's tasks share one spec, and its bytes
        size = self.store.compactor.spec_bytes(job.spec) if held is None else held
        for counts, step in ((self._waiting_by_uid, delta), (self._waiting_bytes_by_uid, delta * size)):
            count = counts.get(job.uid, 0) + step
            if count > 0:
                counts[job.uid] = count
            else:
                counts.pop(job.uid, None)

    def _write_job_mapping(self) -> None:
        if self.config.job_mapping_dir is None:
            return
        active = self.active_jobs()
        try:
            write_job_mapping(self.config.job_mapping_dir, job_mapping(self.inventory.gpus, active))
        except OSError as exc:
            log.warning("cannot write job mapping files in %s: %s", self.config.job_mapping_dir, exc)

    def _notify(self) -> None:
        if not self._notify_pending:  # one wake-up of the watchers covers every change made before it runs
            self._notify_pending = True
            self._spawn(self._notify_all())

    async def _notify_all(self) -> None:
        self._notify_pending = False
        async with self._changed:
            self._changed.notify_all()

    def _spawn(self, coro: Coroutine[Any, Any, None], *, gpu_state: bool = False) -> asyncio.Task[None]:
        """Run `coro` beside the loop. `gpu_state`: it checkpoints or restores a job's GPU state, which
        must not be cut off halfway (the job would stay locked or checkpointed): stop waits for it."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if gpu_state:
            self._gpu_state_moves.add(task)
            task.add_done_callback(self._gpu_state_moves.discard)
        return task
