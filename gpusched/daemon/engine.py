"""The loop: events (submit, exit, tick) -> core plan -> actions carried out via gpu/ and the executor.

The engine holds the in-memory mirror of every unfinished job (the store holds the truth) and is
the only writer of job state. Handlers call its small public methods; they never touch processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import json
import logging
import os
import pwd
import signal
import sqlite3
import time
from collections.abc import Callable, Coroutine
from typing import Any

from gpusched.arrayspec import ArraySpec, ArraySpecError, parse_array_spec
from gpusched.config import DaemonConfig
from gpusched.core.migplan import LayoutChange
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
    unsatisfiable_reason,
)
from gpusched.daemon.arrays import Arrays
from gpusched.daemon.cgroups import CgroupManager
from gpusched.daemon.checkpointing import Checkpoints
from gpusched.daemon.counters import Metrics, pending_since
from gpusched.daemon.devices import DeviceError, DeviceManager, simulator_of
from gpusched.daemon.executor import NEVER_LAUNCHED, Executor, ExitStatus, Trace
from gpusched.daemon.groupcommit import GroupCommit, Write
from gpusched.daemon.jobmap import job_mapping, write_job_mapping
from gpusched.daemon.launch import Launcher, LaunchFailed, allocation_env, cuda_pids, describe, gpu_memory_by_job
from gpusched.daemon.procfs import is_running, session_states
from gpusched.daemon.recovery import StopRequest, Verdict, decide, fallback, outcome, path_to
from gpusched.daemon.store import Store
from gpusched.gpu.backend import GpuBackend, GpuError, Inventory, XidEvent
from gpusched.gpu.checkpoint import CheckpointError
from gpusched.gpu.health import HealthAction
from gpusched.model import (
    ACTIVE_STATES,
    TERMINAL_STATES,
    WAITING_STATES,
    Allocation,
    Dependency,
    Event,
    Job,
    JobSpec,
    JobState,
    spec_bytes,
)
from gpusched.protocol import ErrorCode, ProtocolError, SubmitResult

_HISTORY_EVERY_S = 60.0  # run-time history is saved at most this often (and at shutdown)
log = logging.getLogger("gpusched.engine")

SUSPEND_SETTLE_S = 0.5  # how long after a suspend its SIGSTOP must show in /proc


class Engine:
    """Owns job state transitions; wakes on events and on a tick."""

    def __init__(
        self,
        config: DaemonConfig,
        store: Store,
        backend: GpuBackend,
        executor: Executor,
        scheduler: Scheduler,
        clock: Callable[[], float] = time.time,
        cgroups: CgroupManager | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.backend = backend
        self.executor = executor
        self.scheduler = scheduler
        self.clock = clock
        self.cgroups = cgroups
        self.cgroup_note = ""  # what `doctor` says about per-job cgroups
        self.metrics = Metrics()  # hooks for what /metrics cannot read from state (daemon/counters.py)
        self.devices = DeviceManager(store, backend, config.health_auto_resume_s)
        self.launcher = Launcher(config, executor, cgroups)
        self.checkpoints = Checkpoints.from_config(
            store, enabled=config.checkpoint, binary=config.checkpoint_binary, timeout_s=config.checkpoint_timeout_s,
            sim=config.sim is not None, state_dir=config.state_dir)
        self.jobs: dict[int, Job] = {}
        self._yielded: set[int] = set()  # shares the scheduler suspended in place (store meta `yielded`)
        self._history_saved_at = float("-inf")
        self.inventory = Inventory(gpus=())
        self._wake = asyncio.Event()
        self._changed = asyncio.Condition()
        self._notify_pending = False
        self._stops: dict[int, StopRequest] = {}
        # Final states of ended jobs that pending jobs depend on, looked up in the store once each;
        # only --after targets are cached, so it cannot grow with the number of jobs ever run.
        self._final_states: dict[int, JobState] = {}
        self._active: set[int] = set()  # ids of STARTING / RUNNING / SUSPENDED jobs
        self._waiting_by_uid: dict[int, int] = {}  # PENDING + HELD jobs per uid (max_pending_per_user)
        self._waiting_bytes_by_uid: dict[int, int] = {}  # their spec_bytes (max_pending_bytes_per_user)
        self._submit_tokens: dict[int, tuple[float, float]] = {}  # uid -> (tokens, monotonic time)
        self._awaiting_deps: set[int] = set()  # PENDING jobs kept from the scheduler until --after is met
        self._held_with_deps: set[int] = set()  # HELD jobs with --after (a dependency may fail them)
        self._kill_timers: dict[int, asyncio.TimerHandle] = {}
        self.arrays = Arrays()  # job arrays with unfinished tasks: their environment and %MAX
        self.commits = GroupCommit(store)  # submits share COMMITs (daemon/groupcommit.py)
        self._requests: dict[tuple[int, str], asyncio.Future[tuple[int | None, list[Job]]]] = {}  # in flight
        self._handing: set[int] = set()  # array tasks accepted but not yet handed to the scheduler
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self.passes = 0
        self.shutting_down = False

    # ---- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Load unfinished jobs, recover running ones, read the GPUs, and start the loop."""
        await self.refresh_inventory()
        await self.apply_static_layouts()
        saved = self.store.get_meta("standing")
        load = getattr(self.scheduler, "load_standing", None)
        if saved and callable(load):
            try:
                load(json.loads(saved))
            except Exception:
                log.exception("saved fair-share standing is unreadable; every user starts at lag 0")
        history = self.store.get_meta("runtime_history")
        load_history = getattr(self.scheduler, "load_history", None)
        if history and callable(load_history):
            try:
                load_history(json.loads(history))
            except (ValueError, TypeError, AttributeError) as exc:  # a damaged record costs estimates, not service
                log.warning("ignoring saved run-time history: %s", exc)
        unfinished = self.store.jobs_in(set(JobState) - TERMINAL_STATES)
        live: dict[int, list[Job]] = {}
        for job in unfinished:
            if job.array_id is not None:
                live.setdefault(job.array_id, []).append(job)
        for array_id, row in self.store.arrays(live).items():
            self.arrays.add(array_id, row.tasks, live[array_id][0], live=len(live[array_id]))
        for job in unfinished:
            self.jobs[job.id] = job
            if job.state in ACTIVE_STATES:
                self._active.add(job.id)
                self.arrays.mark_active(job)
            elif job.state in WAITING_STATES:
                self._count_waiting(job, 1)
                if job.state is JobState.HELD and job.spec.after:
                    self._held_with_deps.add(job.id)
        self._stops.update(_load_stops(self.store.get_meta("stop_requests")))
        self._yielded = {i for i in _load_ids(self.store.get_meta("yielded"))
                         if (j := self.jobs.get(i)) is not None and j.state is JobState.SUSPENDED}
        await self._recover()
        self.requeue_all()
        self._write_job_mapping()
        self.devices.start_watching(self._on_gpu_event)
        self._loop_task = asyncio.create_task(self._run(), name="gpusched-engine")

    async def stop(self) -> None:
        """Stop deciding. Running jobs keep running under their shims; the next start re-adopts them."""
        await asyncio.to_thread(self.devices.stop_watching)
        held = {(u, j.uid) for j in self.active_jobs() if j.allocation for u in j.allocation.uuids}
        for uuid, uid in self.launcher.mps.servers():
            if (uuid, uid) not in held:  # MPS daemons of running jobs stay: their clients still need them
                await self.launcher.stop_mps(uuid, uid)
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        for task in list(self._tasks):
            task.cancel()
        for timer in self._kill_timers.values():
            timer.cancel()
        self.executor.detach()
        self._persist_stops()
        self._persist_standing(final=True)

    def wake(self) -> None:
        self._wake.set()

    def begin_shutdown(self) -> None:
        """Release long-polling requests so the server can finish in-flight work promptly."""
        self.shutting_down = True
        self._notify()

    async def _run(self) -> None:
        while True:
            # asyncio.timeout, not wait_for: on Python 3.11 a cancel racing wait_for's own timeout can be
            # lost, leaving stop() waiting on this task for ever (seen under load in the test suite).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.tick_s):
                    await self._wake.wait()
            ticked = not self._wake.is_set()
            self._wake.clear()
            try:
                if ticked:
                    await self.refresh_inventory()
                    self._poll_adopted()
                    self._check_suspended()
                    for device in self.devices.tick(self.clock()):
                        log.info("device %s back in service after its quiet period", device)
                    await self._watch_gpu_memory()
                self._enforce_time_limits()
                await self._pass()
            except Exception:  # the loop must survive a bad pass; the next event retries
                log.exception("scheduling pass failed")

    async def refresh_inventory(self) -> None:
        try:
            self.inventory = await asyncio.to_thread(self.backend.inventory)
        except GpuError as exc:
            log.error("cannot read GPU inventory: %s", exc.message)
        self.checkpoints.driver_version = self.inventory.driver_version or None  # r550+ for cuda-checkpoint

    # ---- requests from handlers ----------------------------------------------------------------

    async def submit(self, *, uid: int, gid: int, user: str, spec: JobSpec, hold: bool = False,
                     array: str | None = None, request_id: str | None = None) -> SubmitResult:
        """Validate against this node, commit (one COMMIT shared with the submits that arrive with it),
        then wake the loop. Returns once the job, or the array and all its tasks, is durable; raises
        ProtocolError. A `request_id` seen before returns what it created, and creates nothing."""
        if request_id is not None:
            known = await self._known_request(uid, request_id)
            if known is not None:
                return known
        tasks = self._array_spec(array) if array is not None else None
        if uid == 0 and not self.config.allow_root_jobs:
            raise ProtocolError(
                ErrorCode.PERMISSION_DENIED, "jobs submitted by root are refused",
                "submit as an ordinary user, or set allow_root_jobs = true in the daemon config",
            )
        reason = unsatisfiable_reason(spec.request, self.inventory.gpus, self.share_modes(), self.dynamic_gpus(),
                                      self.config.mig.toggle_mode)
        if reason is not None:
            raise ProtocolError(ErrorCode.UNSATISFIABLE, f"request can never be satisfied: {reason}")
        count = 1 if tasks is None else tasks.count
        size = spec_bytes(spec) if tasks is None else -(-spec_bytes(spec) // count) * count  # tasks share one spec
        self._check_user_limits(uid, user, size, count)
        for dep in spec.after:
            if self.get(dep.job_id) is None:
                raise ProtocolError(ErrorCode.NOT_FOUND, f"after: no job {dep.job_id} to depend on")
        # Counted now, not at the commit: submits waiting for the same COMMIT must not pass the limits together.
        self._reserve(uid, count, size)
        now = self.clock()

        def apply() -> tuple[int | None, list[Job]]:
            if tasks is None:
                return None, [self.store.submit(uid=uid, gid=gid, user=user, spec=spec, now=now, hold=hold,
                                                request_id=request_id)]
            return self.store.submit_array(uid=uid, gid=gid, user=user, spec=spec, now=now, array=tasks, hold=hold,
                                           request_id=request_id)

        write = Write(apply=apply, committed=lambda done: self._accepted(done, tasks),
                      failed=lambda exc: self._reserve(uid, -count, -size))
        future = self.commits.write(write)
        if request_id is not None:
            self._requests[(uid, request_id)] = future
            future.add_done_callback(lambda _: self._requests.pop((uid, request_id), None))
        try:
            array_id, jobs = await future
        except (OSError, sqlite3.Error) as exc:
            raise ProtocolError(ErrorCode.INTERNAL, f"the job could not be stored: {exc}",
                                "nothing was queued; see the daemon's log") from None
        return _submitted(array_id, jobs, duplicate=False)

    def _array_spec(self, text: str) -> ArraySpec:
        limit = self.config.max_array_size
        try:
            tasks = parse_array_spec(text)
        except ArraySpecError as exc:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"array: {exc}") from None
        if tasks.count > limit:
            raise ProtocolError(ErrorCode.LIMIT_EXCEEDED,
                                f"array {tasks.text}: {tasks.count} tasks; this daemon accepts at most {limit} per "
                                "array (max_array_size)", "split it into several arrays")
        return tasks

    def _accepted(self, done: tuple[int | None, list[Job]], tasks: ArraySpec | None) -> None:
        """A submit is durable: mirror it (its places were reserved when it was checked)."""
        array_id, jobs = done
        if array_id is not None and tasks is not None:
            self.arrays.add(array_id, tasks.text, jobs[0], live=len(jobs))
        for job in jobs:
            self.jobs[job.id] = job
            if job.state is JobState.HELD:
                if job.spec.after:
                    self._held_with_deps.add(job.id)
            elif array_id is None:
                self._enqueue(job)
        if array_id is not None and jobs[0].state is JobState.PENDING:
            self._handing.update(j.id for j in jobs)
            self._spawn(self._hand_over([j.id for j in jobs]))
        self._notify()
        self.wake()

    async def _hand_over(self, ids: list[int]) -> None:
        """An array's tasks reach the scheduler 500 at a time, after the answer went out: 10,000
        scheduler inserts in one go would hold the loop, and every other client, for ~0.2 s."""
        for start in range(0, len(ids), 500):
            await asyncio.sleep(0)
            for job_id in ids[start : start + 500]:
                job = self.jobs.get(job_id)
                if job_id in self._handing and job is not None and job.state is JobState.PENDING:
                    self._handing.discard(job_id)
                    self._enqueue(job)
        self.wake()

    async def _known_request(self, uid: int, request_id: str) -> SubmitResult | None:
        """What an earlier submit with this request_id created (still being committed, or stored)."""
        pending = self._requests.get((uid, request_id))
        if pending is not None:
            array_id, jobs = await asyncio.shield(pending)
            return _submitted(array_id, jobs, duplicate=True)
        made = self.store.submit_key(uid, request_id)
        if made is None:
            return None
        job = self.get(made)
        if job is not None:
            return SubmitResult(job_id=made, state=job.state, duplicate=True)
        first = next(iter(self.store.task_ids(made)), None)
        task = self.get(first) if first is not None else None
        return SubmitResult(job_id=made, state=task.state if task is not None else JobState.PENDING,
                            tasks=len(self.store.task_ids(made)), duplicate=True)

    def _reserve(self, uid: int, count: int, size: int) -> None:
        for counts, step in ((self._waiting_by_uid, count), (self._waiting_bytes_by_uid, size)):
            total = counts.get(uid, 0) + step
            if total > 0:
                counts[uid] = total
            else:
                counts.pop(uid, None)

    def _check_user_limits(self, uid: int, user: str, size: int, count: int = 1) -> None:
        """Per-user limits that keep one user from flooding the queue or the database (root is exempt)."""
        if uid == 0:
            return
        held = self._waiting_bytes_by_uid.get(uid, 0)
        if held + size > self.config.max_pending_bytes_per_user:
            raise ProtocolError(
                ErrorCode.LIMIT_EXCEEDED,
                f"{user}'s pending and held jobs already take {held} bytes of argv, environment and cwd; this one "
                f"({size} bytes) would pass max_pending_bytes_per_user = {self.config.max_pending_bytes_per_user}",
                "submit with a smaller environment (--export), or wait for some jobs to start",
            )
        waiting = self._waiting_by_uid.get(uid, 0)
        if waiting + count > self.config.max_pending_per_user:
            adding = f"; this array's {count} tasks would pass" if count > 1 else ""
            raise ProtocolError(
                ErrorCode.LIMIT_EXCEEDED,
                f"{user} already has {waiting} pending or held jobs{adding} (max_pending_per_user = "
                f"{self.config.max_pending_per_user}; each array task counts)",
                "wait for some to start, or cancel some",
            )
        rate = self.config.submit_rate_per_user
        now = time.monotonic()
        tokens, last = self._submit_tokens.get(uid, (rate * 10, now))
        tokens = min(rate * 10, tokens + (now - last) * rate)  # a token bucket: 10 s of burst
        if tokens < 1:
            raise ProtocolError(ErrorCode.LIMIT_EXCEEDED,
                                f"{user} is submitting faster than {rate:g} jobs/s (submit_rate_per_user)",
                                "slow down, or submit fewer, larger jobs")
        self._submit_tokens[uid] = (tokens - 1, now)

    async def cancel(self, job: Job, reason: str) -> bool:
        """Cancel a job; False if it had already finished."""
        job = self.jobs.get(job.id, job)
        if job.state in TERMINAL_STATES:
            return False
        if job.state in (JobState.PENDING, JobState.HELD, JobState.PREEMPTED):
            self._set(job, JobState.CANCELLED, reason, ended_at=self.clock())
        else:
            self._request_stop(job, StopRequest(JobState.CANCELLED, reason))
        self.wake()
        return True

    def suspend(self, job: Job, reason: str) -> str | None:
        """SIGSTOP a running job's process group; returns why not, or None when done."""
        job = self.jobs.get(job.id, job)
        if job.state is not JobState.RUNNING or not job.pid:
            return f"job is {job.state}, not RUNNING"
        if job.id in self._stops:
            return "job is already being stopped"
        self.executor.signal(job.pid, signal.SIGSTOP)
        self._set(job, JobState.SUSPENDED, f"{reason}; still holds its devices and GPU memory")
        return None

    def resume(self, job: Job, reason: str) -> str | None:
        job = self.jobs.get(job.id, job)
        if job.state is not JobState.SUSPENDED or not job.pid:
            return f"job is {job.state}, not SUSPENDED"
        if self.checkpoints.holds(job):
            return "job is checkpointed (its GPU was given to another job); it resumes when the scheduler gives it back"
        if job.id in self._yielded:
            return ("job was suspended in place for another job; it resumes when its compute is free again "
                    "(the scheduler does it)")
        self.executor.signal(job.pid, signal.SIGCONT)
        self._set(job, JobState.RUNNING, reason)
        return None

    def hold(self, job: Job, reason: str) -> str | None:
        job = self.jobs.get(job.id, job)
        if job.state is not JobState.PENDING:
            return f"job is {job.state}, not PENDING"
        self._set(job, JobState.HELD, reason)
        return None

    def release(self, job: Job, reason: str) -> str | None:
        job = self.jobs.get(job.id, job)
        if job.state is not JobState.HELD:
            return f"job is {job.state}, not HELD"
        self._set(job, JobState.PENDING, reason)
        self.wake()
        return None

    # ---- devices -------------------------------------------------------------------------------

    def _on_gpu_event(self, event: XidEvent) -> None:
        """An XID (or a lost GPU) from the driver: apply the policy to the jobs on those devices."""
        now = self.clock()
        self.metrics.record_xid(event.gpu_index, event.xid)
        decision = self.devices.on_event(event, self.inventory, now)
        hit = set(decision.devices)
        for job in self.active_jobs():
            if job.allocation is None or not hit & set(job.allocation.uuids):
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

    async def apply_static_layouts(self) -> None:
        """Give GPUs configured with `mig = [...]` that layout (idle instances only are changed), and switch
        simulated GPUs configured with any MIG setting into MIG mode."""
        for key, gpu_config in sorted(self.config.gpus.items()):
            if gpu_config.mig is None:
                continue
            index = int(key)
            gpu = next((g for g in self.inventory.gpus if g.index == index), None)
            if gpu is None:
                log.error("config gpus.%s: there is no GPU %s", key, key)
                continue
            if not gpu.mig_enabled and simulator_of(self.backend) is not None:
                await asyncio.to_thread(self.backend.set_mig_mode, index, True)  # a simulated GPU starts as told
                await self.refresh_inventory()
            if gpu_config.mig == "dynamic":
                continue  # the scheduler plans this GPU's layout from demand
            try:
                change, done = await self.apply_mig_layout(index, gpu_config.mig, dry_run=False)
            except (DeviceError, GpuError) as exc:
                log.error("config gpus.%s.mig: %s", key, getattr(exc, "message", str(exc)))
                continue
            if change.error is not None:
                log.error("config gpus.%s.mig: %s", key, change.error)
            for line in done:
                log.info("GPU %d: %s", index, line)

    def get(self, job_id: int) -> Job | None:
        return self.jobs.get(job_id) or self.store.get(job_id)

    async def wait_for_change(self, timeout: float) -> None:
        """Block until any job changes state, the daemon starts shutting down, or the timeout passes."""
        if self.shutting_down:
            return
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout)

    def waiting_reason(self, job: Job) -> str | None:
        if job.state is JobState.HELD:
            return "held: `gpusched release` lets it start"
        if job.state is not JobState.PENDING:
            return None
        unmet = [d for d in job.spec.after if self._dependency_status(d) is None]
        if unmet:
            return "waiting for " + ", ".join(
                f"job {d.job_id} to {'complete' if d.condition == 'ok' else 'end'}" for d in unmet)
        explain = getattr(self.scheduler, "explain", None)
        if callable(explain):
            return str(explain(job.id))
        ahead = sum(1 for j in self.jobs.values() if j.state is JobState.PENDING and j.id < job.id)
        return f"waiting for free devices; {ahead} job(s) ahead in the queue"

    # ---- the pass ------------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        if self._incremental:
            pending: tuple[Job, ...] = ()  # the scheduler holds its own queue (see _enqueue)
        else:
            pending = tuple(sorted((j for j in self.jobs.values() if j.state is JobState.PENDING and self._ready(j)
                                    and self.arrays.is_admitted(j)), key=lambda j: j.id))
        return Snapshot(
            gpus=self.inventory.gpus,
            pending=pending,
            active=tuple(j for i in sorted(self._active) if (j := self.jobs[i]).allocation is not None),
            unschedulable=self.devices.unschedulable(self.inventory),
            share_modes=self.share_modes(),
            dynamic=self.dynamic_gpus(),
            mps_owner=self._mps_owners(),
            reserved_interactive=self._reserved_interactive(),
            checkpoint=self.checkpoints.enabled,
            yielded=frozenset(self._yielded),
        )

    def active_jobs(self) -> list[Job]:
        """STARTING / RUNNING / SUSPENDED jobs, from the index (never a scan of the whole queue)."""
        return [self.jobs[i] for i in sorted(self._active) if i in self.jobs]

    @property
    def _incremental(self) -> bool:
        return bool(getattr(self.scheduler, "incremental", False))

    def share_modes(self) -> dict[str, str]:
        """Device UUID -> mps | timeslice for GPUs (and their MIG instances) configured to be shared."""
        modes: dict[str, str] = {}
        for gpu in self.inventory.gpus:
            gpu_config = self.config.gpus.get(str(gpu.index))
            if gpu_config is not None and gpu_config.share != "exclusive":
                modes[gpu.uuid] = gpu_config.share
                modes.update((i.uuid, gpu_config.share) for i in gpu.instances)
        return modes

    def dynamic_gpus(self) -> frozenset[int]:
        return frozenset(int(k) for k, g in self.config.gpus.items() if g.mig == "dynamic")

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

    def _dependency_status(self, dep: Dependency) -> bool | None:
        """True when met, False when it can never be met, None while the other job has not ended."""
        other = self.jobs.get(dep.job_id)
        if other is not None:
            return None  # unfinished jobs live in self.jobs
        final = self._final_states.get(dep.job_id)
        if final is None:
            ended = self.store.get(dep.job_id)
            if ended is None:
                return False
            final = self._final_states[dep.job_id] = ended.state
        return dep.condition == "any" or final is JobState.COMPLETED

    def _enqueue(self, job: Job) -> None:
        """A job became PENDING: the scheduler gets it once its dependencies are met (and, for a task of
        an array with %MAX, once fewer than MAX of its array's tasks are queued or running)."""
        if not self.arrays.admit(job) or not self._incremental:
            return
        if self._ready(job):
            self._awaiting_deps.discard(job.id)
            self.scheduler.submit(job)
        else:
            self._awaiting_deps.add(job.id)

    def _release_met_dependencies(self) -> None:
        for job_id in sorted(self._awaiting_deps):
            job = self.jobs.get(job_id)
            if job is None or job.state is not JobState.PENDING:
                self._awaiting_deps.discard(job_id)
            elif self._ready(job):
                self._enqueue(job)

    def requeue_all(self) -> None:
        """Hand every pending job to a fresh scheduler, in submission order (start-up, reload), with
        the checkpointed ones pinned to the GPUs that hold their state."""
        self._handing.clear()  # array tasks not handed over yet go now, with the others
        for job in sorted(self.jobs.values(), key=lambda j: j.id):
            if job.state is JobState.PENDING:
                self._enqueue(job)
            elif self.checkpoints.holds(job) and self._incremental:
                self.scheduler.pin(job.id, self.checkpoints.pinned[job.id])
                self.scheduler.submit(job)
            elif job.id in self.checkpoints.pinned and job.state is JobState.SUSPENDED:
                self._spawn(self._restore(job))  # the daemon stopped while restoring it: finish that
                continue
        for job_id in [i for i, j in ((i, self.jobs.get(i)) for i in self.checkpoints.pinned)
                       if j is None or j.state is not JobState.SUSPENDED]:
            self.checkpoints.forget(job_id)  # ended, or restored, while the daemon was down

    def _ready(self, job: Job) -> bool:
        return all(self._dependency_status(d) for d in job.spec.after)

    def _fail_broken_dependencies(self) -> None:
        waiting = [self.jobs[i] for i in sorted(self._awaiting_deps) if i in self.jobs]
        held = [self.jobs[i] for i in sorted(self._held_with_deps) if i in self.jobs]
        for job in waiting + held if self._incremental else list(self.jobs.values()):
            if job.state not in (JobState.PENDING, JobState.HELD):
                continue
            for dep in job.spec.after:
                if self._dependency_status(dep) is False:
                    final = self._final_states.get(dep.job_id, "unknown")
                    self._set(job, JobState.FAILED,
                              f"dependency can never be met: job {dep.job_id} ended {final}, needed COMPLETED",
                              ended_at=self.clock())
                    break

    async def _pass(self) -> None:
        self.passes += 1
        began = time.perf_counter()
        self._fail_broken_dependencies()
        self._release_met_dependencies()
        actions = self.scheduler.plan(self.snapshot(), self.clock())
        if actions or self.passes % 30 == 0:
            self._persist_standing()
        for action in actions:
            await self._apply(action)
        self.metrics.observe_pass(time.perf_counter() - began)

    async def _apply(self, action: Action) -> None:
        if isinstance(action, StartJob):
            await self._start(action)
        elif isinstance(action, FailJob):
            job = self.jobs.get(action.job_id)
            if job is not None and job.state in (JobState.PENDING, JobState.HELD):
                self._set(job, JobState.FAILED, action.reason, ended_at=self.clock())
        elif isinstance(action, PreemptJob):
            job = self.jobs.get(action.job_id)
            if job is not None and action.mode == "checkpoint":
                self._spawn(self._checkpoint(job, action.reason))
            elif job is not None and action.mode == "suspend":
                self._yield(job, action.reason)
            elif job is not None and job.state in ACTIVE_STATES and job.spec.requeue:
                self._request_stop(job, StopRequest(JobState.PREEMPTED, action.reason))
        elif isinstance(action, ResumeJob):
            job = self.jobs.get(action.job_id)
            if job is not None and job.state is JobState.SUSPENDED and job.id in self._yielded and job.pid:
                self._set_yielded(job.id, False)
                self.executor.signal(job.pid, signal.SIGCONT)
                self._set(job, JobState.RUNNING, action.reason)
        elif isinstance(action, SetMigMode):
            await self._set_mig_mode(action)
        elif isinstance(action, CreateInstance):
            if await self._gpu_call(self.backend.create_instance, action.gpu_index, action.profile, action.start):
                self.metrics.record_mig_reconfiguration(action.gpu_index)
                self.store.add_event(Event(at=self.clock(), kind="mig_create", gpu=action.gpu_index,
                                           message=f"created {action.profile} at {action.start}: {action.reason}"))
        elif isinstance(action, DestroyInstance):
            gpu_index = next((g.index for g in self.inventory.gpus for i in g.instances if i.uuid == action.uuid), -1)
            if await self._gpu_call(self.backend.destroy_instance, action.uuid):
                self.metrics.record_mig_reconfiguration(gpu_index)
                self.store.add_event(Event(at=self.clock(), kind="mig_destroy", gpu=gpu_index, device=action.uuid,
                                           message=f"destroyed {action.uuid}: {action.reason}"))

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

    async def _start(self, action: StartJob) -> None:
        """Commit STARTING with the devices, then launch off the pass: nothing a job's user controls
        (everything between the shim's fork and the job's exec runs as that user) can stall it."""
        job = self.jobs.get(action.job_id)
        if job is not None and self.checkpoints.holds(job):
            job = self.jobs[job.id] = self.store.update(job, allocation=action.allocation)  # held from now on
            self._spawn(self._restore(job))
            return
        if job is None or job.state is not JobState.PENDING:
            return
        now = self.clock()
        self.metrics.observe_wait(now - pending_since(job))
        try:
            added = allocation_env(job, action.allocation, self.config) | await self.launcher.share_env(
                action.allocation, self.share_modes(), job.uid) | self.arrays.env(job)
        except GpuError as exc:
            self._set(job, JobState.FAILED, f"could not start MPS for its device: {exc.message}", ended_at=now)
            return
        allocation = action.allocation.model_copy(update={"env": added})  # `show` lists what the job got
        job = self._set(job, JobState.STARTING, action.reason, allocation=allocation, started_at=now)
        self._spawn(self._launch(job, allocation, added))

    async def _launch(self, job: Job, allocation: Allocation, added: dict[str, str]) -> None:
        """Start the job's shim (with the launch deadline), record RUNNING, then reap it."""
        try:
            started = await self.launcher.start(job, allocation, added, self.inventory, self.config.launch_timeout_s,
                                                on_pid=lambda pid: self._on_pid(job.id, pid))
        except LaunchFailed as exc:
            current = self.jobs.get(job.id)
            self._cleanup(job.id)
            if current is not None and current.state is JobState.STARTING:
                self._end(current, JobState.FAILED, str(exc), ended_at=self.clock())
            return
        current = self.jobs.get(job.id)
        if started.timed_out and current is not None:
            self._stops.setdefault(job.id, StopRequest(JobState.FAILED, started.error or "launch timed out"))
            self._persist_stops()
        elif current is not None and current.state is JobState.STARTING and not started.error:
            current = self._set(current, JobState.RUNNING, "started", pid=started.pid)
            if current.id in self._stops:  # cancelled (or timed out) while it was starting
                self._signal_stop(current)
        # With an error the job never ran (no such executable, bad cwd, ...); the shim has recorded
        # why, and reaping moves it STARTING -> FAILED with that reason.
        await self._reap(job.id)

    def _yield(self, job: Job, reason: str) -> None:
        """Preempt a share by suspending it in place (SIGSTOP): it keeps its GPU memory and MPS slot,
        gives up its compute, and continues on a ResumeJob. Nothing is lost."""
        if job.state is not JobState.RUNNING or not job.pid or job.id in self._stops:
            self.scheduler.preempt_failed(job.id)
            return
        self._set_yielded(job.id, True)
        self.executor.signal(job.pid, signal.SIGSTOP)
        self._set(job, JobState.SUSPENDED, reason)

    def _set_yielded(self, job_id: int, on: bool) -> None:
        if on == (job_id in self._yielded):
            return
        if on:
            self._yielded.add(job_id)
        else:
            self._yielded.discard(job_id)
        self.store.set_meta("yielded", json.dumps(sorted(self._yielded)))

    async def _checkpoint(self, job: Job, reason: str) -> None:
        """Preempt by checkpoint (daemon/checkpointing.py): the job keeps its processes and its work,
        gives up its GPU, and waits pinned to it. Any failure leaves it running where it was."""
        why_not = self.checkpoints.why_not(job)
        if why_not is None and job.id in self._stops:
            why_not = "job is being stopped"
        if why_not is None:
            try:
                pids = await asyncio.to_thread(cuda_pids, self.backend, job)
                await self.checkpoints.checkpoint(job, pids)
            except CheckpointError as exc:
                why_not = f"{exc.message} (its CUDA state: {exc.state or 'unknown'})"
        current = self.jobs.get(job.id)
        if why_not is None and (current is None or current.state is not JobState.RUNNING):
            why_not = "it changed state while being checkpointed"  # it ended; its end releases the GPU
            self.checkpoints.forget(job.id)
        if why_not is not None or current is None:
            log.warning("job %d: not preempted by checkpoint: %s", job.id, why_not)
            self.store.add_event(Event(at=self.clock(), kind="checkpoint_failed", job_id=job.id,
                                       message=f"not checkpointed, runs on: {why_not}"))
            self.scheduler.preempt_failed(job.id)
            self.wake()
            return
        current = self._set(current, JobState.SUSPENDED, reason, allocation=None)
        self.scheduler.pin(current.id, self.checkpoints.pinned[current.id])
        self.scheduler.submit(current)
        self.store.add_event(Event(at=self.clock(), kind="checkpoint", job_id=job.id,
                                   message=f"checkpointed; its GPU state waits in host memory: {reason}"))
        self.wake()

    async def _restore(self, job: Job) -> None:
        """Give a checkpointed job its GPU state back on the devices it was given (the pinned ones)."""
        try:
            await self.checkpoints.restore(job)
        except CheckpointError as exc:
            current = self.jobs.get(job.id)
            if current is not None and current.state is JobState.SUSPENDED:
                final = JobState.PREEMPTED if current.spec.requeue else JobState.FAILED
                self._request_stop(current, StopRequest(final, f"restore from checkpoint failed: {exc.message}"))
            return
        finally:
            self.checkpoints.forget(job.id)
        current = self.jobs.get(job.id)
        if current is not None and current.state is JobState.SUSPENDED and current.id not in self._stops:
            self._set(current, JobState.RUNNING, "restored from checkpoint on the devices that held its state")
        self.wake()

    def _on_pid(self, job_id: int, pid: int) -> None:
        """The shim has forked the job: a stop requested meanwhile can reach it now (even unexec'd)."""
        job = self.jobs.get(job_id)
        if job is not None and job.state is JobState.STARTING:
            job = self.jobs[job_id] = self.store.update(job, pid=pid)
            if job_id in self._stops:
                self._signal_stop(job)

    async def _reap(self, job_id: int) -> None:
        status = await self.executor.wait(job_id)
        if status is not None:
            self._finish(job_id, status)

    def _poll_adopted(self) -> None:
        """Jobs re-adopted after a restart are not our children: apply the restart rules each tick."""
        for job in self.active_jobs():
            if not self.executor.owns(job.id) and job.id not in self.launcher.in_flight:
                self._recover_job(job)

    async def _recover(self) -> None:
        """Explicit restart rules (daemon/recovery.py) for every unfinished job; none can stop the start."""
        launched = self.executor.launched()
        for job in list(self.jobs.values()):
            self._recover_job(job, None if job.id in launched else NEVER_LAUNCHED)

    def _recover_job(self, job: Job, trace: Trace | None = None) -> None:
        """Apply the restart rule for one job; whatever goes wrong ends that job, never the daemon.
        `trace`: what is known already (NEVER_LAUNCHED for a job with no directory at start-up)."""
        try:
            trace = trace or self.executor.inspect(job.id)
            rule = decide(job.state, trace)
            if rule.kill:
                self.executor.kill_job(job.id)
            if rule.verdict is Verdict.FINISH and trace.exit is not None:
                if job.state is JobState.STARTING and trace.pid and not trace.exit.error:
                    job = self.jobs[job.id] = self.store.update(job, pid=trace.pid)
                self._finish(job.id, trace.exit)
            elif rule.verdict is Verdict.ADOPT:
                if job.state is JobState.STARTING:
                    job = self._set(job, JobState.RUNNING, rule.reason, pid=trace.pid)
                elif job.pid != trace.pid and trace.pid:
                    job = self.jobs[job.id] = self.store.update(job, pid=trace.pid)
                if job.id in self._stops:
                    self._request_stop(job, self._stops[job.id])
            elif rule.verdict is Verdict.REQUEUE:
                if job.state is JobState.STARTING and not self.executor.revoke(job.id):
                    return  # a shim took the launch after all: the next tick sees it run
                self._set(job, JobState.PENDING, rule.reason, allocation=None, pid=None, started_at=None,
                          ended_at=None, exit_code=None, signal=None)
            elif rule.verdict is Verdict.LOST:
                self._cleanup(job.id)
                self._end(job, JobState.LOST, rule.reason, ended_at=self.clock())
        except Exception as exc:
            log.exception("job %d: recovery failed", job.id)
            self._abandon(job.id, f"recovery failed: {describe(exc)}")

    def _abandon(self, job_id: int, reason: str) -> None:
        """The last resort for a job no rule could handle: kill what is left, end it LOST or FAILED."""
        job = self.store.get(job_id) or self.jobs.get(job_id)
        if job is None:
            self.jobs.pop(job_id, None)
            return
        with contextlib.suppress(Exception):
            self.executor.kill_job(job_id)
            self._cleanup(job_id)
        try:
            self._end(job, fallback(job.state), reason, ended_at=self.clock())
        except Exception:
            log.exception("job %d: cannot record its end; no longer tracked", job_id)
            self.jobs.pop(job_id, None)
            self._active.discard(job_id)

    def _end(self, job: Job, final: JobState, reason: str, **fields: object) -> Job:
        """Move a job to `final` by legal steps (a STARTING job that ran passes through RUNNING)."""
        if job.state in TERMINAL_STATES:
            return job
        steps = path_to(job.state, final)
        for state in steps[:-1]:
            job = self._set(job, state, "ran (recorded after the fact)")
        if steps[-1] is not final:
            reason = f"{reason} (ended {steps[-1]}: no way from {job.state} to {final})"
        return self._set(job, steps[-1], reason, **fields)

    def _cleanup(self, job_id: int) -> None:
        """Forget a job's stop request and timers, and give back its MPS share and cgroup."""
        job = self.jobs.get(job_id)
        if job is not None:
            for uuid in self.launcher.idle_mps(job, self.active_jobs()):
                self._spawn(self.launcher.stop_mps(uuid, job.uid))  # a later share restarts it
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

    def _finish(self, job_id: int, status: ExitStatus) -> None:
        job = self.jobs.get(job_id)
        if job is None or job.state in TERMINAL_STATES:
            return
        stop = self._stops.get(job_id)
        self._cleanup(job_id)
        ended = status.ended_at or self.clock()
        fields: dict[str, object] = {"exit_code": status.exit_code, "signal": status.signal, "ended_at": ended}
        final, reason = outcome(status, stop)
        job = self._end(job, final, reason, **fields)
        if job.state is JobState.PREEMPTED:
            self._set(job, JobState.PENDING, "requeued after preemption", allocation=None, pid=None,
                      started_at=None, ended_at=None, exit_code=None, signal=None)
        self.wake()

    # ---- stopping running jobs -----------------------------------------------------------------

    def _request_stop(self, job: Job, stop: StopRequest) -> None:
        """SIGTERM the job's process group now, SIGKILL after the grace period."""
        if job.id in self._kill_timers:
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

    def _check_suspended(self) -> None:
        """A SUSPENDED job's owner can SIGCONT it: a job that runs again is RUNNING, and its clock runs.

        Checked from /proc (every process of the job's session stopped, or dead) a moment after the
        suspend, so the SIGSTOP has certainly landed.
        """
        now = self.clock()
        suspended = {j.pid: j for j in self.active_jobs() if j.state is JobState.SUSPENDED and j.pid
                     and j.id not in self._stops and now - j.history[-1].at >= SUSPEND_SETTLE_S
                     and j.id not in self.checkpoints.pinned}
        for sid, states in session_states(suspended).items():
            if is_running(states):
                self._set(suspended[sid], JobState.RUNNING, "continued by a signal gpusched did not send while "
                          "suspended; it runs again, and its time counts")

    def _enforce_time_limits(self) -> None:
        now = self.clock()
        for job in self.active_jobs():
            limit = job.spec.time_limit_s
            if job.state is JobState.RUNNING and limit is not None and job.id not in self._stops \
                    and run_seconds(job, now) > limit:
                self._request_stop(job, StopRequest(JobState.TIMEOUT, f"time limit of {limit:g}s reached"))

    async def _watch_gpu_memory(self) -> None:
        """In `timeslice` mode nothing in the hardware caps memory: end a job that uses more than it asked."""
        modes = self.share_modes()
        watched = [j for j in self.active_jobs() if j.state is JobState.RUNNING and j.allocation is not None
                   and j.allocation.gpu_mem_mib is not None and j.id not in self._stops
                   and any(modes.get(u) == "timeslice" for u in j.allocation.uuids)]
        if not watched:
            return
        used = await asyncio.to_thread(gpu_memory_by_job, self.backend, watched)
        for job in watched:
            limit = job.allocation.gpu_mem_mib if job.allocation is not None else None
            if limit is not None and used.get(job.id, 0) > limit:
                reason = f"gpu_mem exceeded: its processes use {used[job.id]} MiB, over its --gpu-mem of {limit} MiB"
                self._request_stop(job, StopRequest(JobState.FAILED, reason))

    def _persist_standing(self, *, final: bool = False) -> None:
        """Each user's place (lag, service) survives restarts and crashes; so do the recent run times
        the estimates come from, written at most once a minute (they can be megabytes) and at shutdown."""
        export = getattr(self.scheduler, "export_standing", None)
        if callable(export):
            self.store.set_meta("standing", json.dumps(export()))
        history = getattr(self.scheduler, "export_history", None)
        now = self.clock()
        if callable(history) and (final or now - self._history_saved_at >= _HISTORY_EVERY_S):
            self.store.set_meta("runtime_history", json.dumps(history()))
            self._history_saved_at = now

    def _persist_stops(self) -> None:
        self.store.set_meta(
            "stop_requests", json.dumps({str(k): [v.final.value, v.reason] for k, v in self._stops.items()})
        )

    # ---- bookkeeping ---------------------------------------------------------------------------

    def _set(self, job: Job, state: JobState, reason: str, **fields: object) -> Job:
        updated = self.store.transition(job, state, now=self.clock(), reason=reason, **fields)
        self._handing.discard(job.id)  # whatever its state now, this change decides what the scheduler gets
        if state in TERMINAL_STATES:
            self.jobs.pop(job.id, None)
            observe = getattr(self.scheduler, "observe_end", None)
            if job.state in ACTIVE_STATES and callable(observe):
                observe(updated)  # its run time teaches the estimates (core/estimate.py)
        else:
            self.jobs[job.id] = updated
        log.info("job %d: %s -> %s (%s)", job.id, job.state, state, reason)
        if state in ACTIVE_STATES:
            self._active.add(job.id)
        else:
            self._active.discard(job.id)
        if state is JobState.HELD and job.spec.after:
            self._held_with_deps.add(job.id)
        else:
            self._held_with_deps.discard(job.id)
        if (state in WAITING_STATES) != (job.state in WAITING_STATES):
            self._count_waiting(job, 1 if state in WAITING_STATES else -1)
        if state is JobState.PENDING and job.state is not JobState.PENDING:
            self._enqueue(updated)  # submitted, released, or requeued after preemption
        elif job.state is JobState.PENDING and state is not JobState.STARTING and self._incremental:
            self._awaiting_deps.discard(job.id)
            self.scheduler.remove(job.id)  # cancelled, held or failed: StartJob already dequeued it
        if job.id in self._yielded and state is not JobState.SUSPENDED:
            self._set_yielded(job.id, False)  # resumed, continued by a signal, or ended
        if state in TERMINAL_STATES and job.id in self.checkpoints.pinned:
            self.checkpoints.forget(job.id)
            self.scheduler.remove(job.id)  # ended while checkpointed (cancelled, killed): no restore
        if (job.state in ACTIVE_STATES) != (state in ACTIVE_STATES):
            self._write_job_mapping()
        if job.array_id is not None and (state in TERMINAL_STATES or state is JobState.HELD):
            for freed in self.arrays.leave(updated, ended=state in TERMINAL_STATES):  # %MAX: the next task may go
                if freed in self.jobs:
                    self._enqueue(self.jobs[freed])
        self._notify()
        return updated

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

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def weight_of(self, user: str) -> float:
        """A user's configured fair-share weight (by name, else by uid, else the default)."""
        fairness = self.config.fairness
        if user in fairness.weights:
            return float(fairness.weights[user])
        try:
            uid = str(pwd.getpwnam(user).pw_uid)
        except KeyError:
            uid = user if user.isdigit() else ""
        return float(fairness.weights.get(uid, fairness.default_weight))

    def user_name(self, uid: int) -> str:
        try:
            return pwd.getpwuid(uid).pw_name
        except KeyError:
            return str(uid)

    def is_admin(self, uid: int) -> bool:
        """Root, the daemon's own user, or a member of the configured admin group."""
        if uid in (0, os.geteuid()):
            return True
        group = self.config.admin_group
        if not group:
            return False
        try:
            entry = grp.getgrnam(group)
            name = pwd.getpwuid(uid).pw_name
        except KeyError:
            return False
        return name in entry.gr_mem or pwd.getpwuid(uid).pw_gid == entry.gr_gid


def _submitted(array_id: int | None, jobs: list[Job], *, duplicate: bool) -> SubmitResult:
    if array_id is None:
        return SubmitResult(job_id=jobs[0].id, state=jobs[0].state, duplicate=duplicate)
    return SubmitResult(job_id=array_id, state=jobs[0].state, tasks=len(jobs), duplicate=duplicate)


def run_seconds(job: Job, now: float) -> float:
    """Time the job has spent RUNNING in its current run (suspended time does not count)."""
    total, since = 0.0, None
    for t in job.history:
        if t.state is JobState.RUNNING:
            since = t.at
        elif since is not None:
            total += t.at - since
            since = None
        if t.state is JobState.PENDING:  # a requeue starts a new run
            total, since = 0.0, None
    if since is not None:
        total += now - since
    return total


def _load_ids(saved: str | None) -> list[int]:
    """A persisted list of job ids; anything else is dropped (logged), never fatal."""
    try:
        data = json.loads(saved) if saved else []
    except ValueError:
        data = None
    if not isinstance(data, list):
        log.error("saved job list %r is unreadable; dropped", (saved or "")[:200])
        return []
    return [i for i in data if isinstance(i, int) and not isinstance(i, bool)]


def _load_stops(saved: str | None) -> dict[int, StopRequest]:
    """The persisted stop requests; an unreadable entry is dropped (logged), never fatal."""
    stops: dict[int, StopRequest] = {}
    try:
        entries = json.loads(saved) if saved else {}
        items = entries.items() if isinstance(entries, dict) else []
    except ValueError:
        log.error("saved stop requests are unreadable; running jobs keep running")
        items = []
    for key, value in items:
        try:
            final, reason = value
            stops[int(key)] = StopRequest(JobState(final), str(reason))
        except (TypeError, ValueError):
            log.error("saved stop request %r: %r is unreadable; dropped", key, value)
    return stops
