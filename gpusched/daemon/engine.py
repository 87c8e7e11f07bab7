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
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from gpusched.config import DaemonConfig
from gpusched.core.migplan import LayoutChange
from gpusched.core.scheduler import (
    Action,
    CreateInstance,
    DestroyInstance,
    FailJob,
    PreemptJob,
    Scheduler,
    Snapshot,
    StartJob,
    unsatisfiable_reason,
)
from gpusched.daemon.cgroups import CgroupError, CgroupManager
from gpusched.daemon.devices import DeviceError, DeviceManager, simulator_of
from gpusched.daemon.executor import Executor, ExitStatus
from gpusched.daemon.jobmap import job_mapping, write_job_mapping
from gpusched.daemon.launch import (
    allocation_env,
    cpu_and_memory_limits,
    gpu_memory_by_job,
    identity,
    job_env,
    mps_control_binary,
)
from gpusched.daemon.metrics import Metrics, pending_since
from gpusched.daemon.store import Store
from gpusched.gpu.backend import GpuBackend, GpuError, Inventory, XidEvent
from gpusched.gpu.health import HealthAction
from gpusched.gpu.mps import MpsManager
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
from gpusched.protocol import ErrorCode, ProtocolError

log = logging.getLogger("gpusched.engine")


@dataclass(frozen=True, slots=True)
class StopRequest:
    """Why a running job is being stopped, and the state it ends in once it has exited."""

    final: JobState
    reason: str


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
        self.metrics = Metrics()  # hooks for what /metrics cannot read from state (daemon/metrics.py)
        self.devices = DeviceManager(store, backend, config.health_auto_resume_s)
        self.mps = MpsManager(os.path.join(config.state_dir, "mps"), control_binary=mps_control_binary(config))
        self.jobs: dict[int, Job] = {}
        self.inventory = Inventory(gpus=())
        self._wake = asyncio.Event()
        self._changed = asyncio.Condition()
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
            load(json.loads(saved))
        for job in self.store.jobs_in(set(JobState) - TERMINAL_STATES):
            self.jobs[job.id] = job
            if job.state in ACTIVE_STATES:
                self._active.add(job.id)
            elif job.state in WAITING_STATES:
                self._count_waiting(job, 1)
                if job.state is JobState.HELD and job.spec.after:
                    self._held_with_deps.add(job.id)
        stops = self.store.get_meta("stop_requests")
        for key, (final, reason) in (json.loads(stops) if stops else {}).items():
            self._stops[int(key)] = StopRequest(JobState(final), reason)
        await self._recover()
        self.requeue_all()
        self._write_job_mapping()
        self.devices.start_watching(self._on_gpu_event)
        self._loop_task = asyncio.create_task(self._run(), name="gpusched-engine")

    async def stop(self) -> None:
        """Stop deciding. Running jobs keep running under their shims; the next start re-adopts them."""
        await asyncio.to_thread(self.devices.stop_watching)
        held = {u for j in self.active_jobs() if j.allocation for u in j.allocation.uuids}
        for uuid in self.mps.devices():
            if uuid not in held:  # MPS daemons of running jobs stay: their clients still need them
                await self._stop_mps(uuid)
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
        self._persist_standing()

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

    # ---- requests from handlers ----------------------------------------------------------------

    def submit(self, *, uid: int, gid: int, user: str, spec: JobSpec, hold: bool = False) -> Job:
        """Validate against this node, commit, then wake the loop. Raises ProtocolError."""
        if uid == 0 and not self.config.allow_root_jobs:
            raise ProtocolError(
                ErrorCode.PERMISSION_DENIED, "jobs submitted by root are refused",
                "submit as an ordinary user, or set allow_root_jobs = true in the daemon config",
            )
        reason = unsatisfiable_reason(spec.request, self.inventory.gpus, self.share_modes(), self.dynamic_gpus())
        if reason is not None:
            raise ProtocolError(ErrorCode.UNSATISFIABLE, f"request can never be satisfied: {reason}")
        self._check_user_limits(uid, user, spec_bytes(spec))
        for dep in spec.after:
            if self.get(dep.job_id) is None:
                raise ProtocolError(ErrorCode.NOT_FOUND, f"after: no job {dep.job_id} to depend on")
        job = self.store.submit(uid=uid, gid=gid, user=user, spec=spec, now=self.clock())
        self.jobs[job.id] = job
        self._count_waiting(job, 1)
        if hold:
            job = self._set(job, JobState.HELD, "held at submission")
        else:
            self._enqueue(job)
        self._notify()
        self.wake()
        return job

    def _check_user_limits(self, uid: int, user: str, size: int) -> None:
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
        if waiting >= self.config.max_pending_per_user:
            raise ProtocolError(
                ErrorCode.LIMIT_EXCEEDED,
                f"{user} already has {waiting} pending or held jobs (max_pending_per_user = "
                f"{self.config.max_pending_per_user})", "wait for some to start, or cancel some",
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
            pending = tuple(sorted((j for j in self.jobs.values() if j.state is JobState.PENDING and self._ready(j)),
                                   key=lambda j: j.id))
        return Snapshot(
            gpus=self.inventory.gpus,
            pending=pending,
            active=tuple(self.jobs[i] for i in sorted(self._active)),
            unschedulable=self.devices.unschedulable(self.inventory),
            share_modes=self.share_modes(),
            dynamic=self.dynamic_gpus(),
            mps_owner=self._mps_owners(),
            reserved_interactive=self._reserved_interactive(),
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
        """A job became PENDING: the scheduler gets it once its dependencies are met."""
        if not self._incremental:
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
        """Hand every pending job to a fresh scheduler, in submission order (start-up, reload)."""
        for job in sorted(self.jobs.values(), key=lambda j: j.id):
            if job.state is JobState.PENDING:
                self._enqueue(job)

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
            if job is not None and job.state in ACTIVE_STATES and job.spec.requeue:
                self._request_stop(job, StopRequest(JobState.PREEMPTED, action.reason))
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
        job = self.jobs.get(action.job_id)
        if job is None or job.state is not JobState.PENDING:
            return
        now = self.clock()
        self.metrics.observe_wait(now - pending_since(job))
        try:
            added = allocation_env(job, action.allocation, self.config) | await self._mps_env(action.allocation)
        except GpuError as exc:
            self._set(job, JobState.FAILED, f"could not start MPS for its device: {exc.message}", ended_at=now)
            return
        allocation = action.allocation.model_copy(update={"env": added})  # `show` lists what the job got
        job = self._set(job, JobState.STARTING, action.reason, allocation=allocation, started_at=now)
        try:
            who = identity(job)
            cgroup, cpuset = cpu_and_memory_limits(job, allocation, self.inventory, self.cgroups)
            started = await self.executor.start(job.id, job.spec.argv, job.spec.cwd, job_env(job, added), who,
                                                cgroup, cpuset)
        except (OSError, KeyError, CgroupError) as exc:
            self._set(job, JobState.FAILED, f"could not launch: {exc}", ended_at=self.clock())
            return
        job = self.jobs[job.id]
        if not started.error:
            job = self._set(job, JobState.RUNNING, "started", pid=started.pid)
            stop = self._stops.get(job.id)
            if stop is not None:  # cancelled (or timed out) while it was starting
                self._signal_stop(job)
        # With an error the job never ran (no such executable, bad cwd, ...); the shim has recorded
        # why, and reaping moves it STARTING -> FAILED with that reason.
        self._spawn(self._reap(job.id))

    def _release_mps(self, ended: Job) -> None:
        """Quit a device's MPS control daemon once its last share has ended (a later share restarts it)."""
        if ended.allocation is None or ended.allocation.share is None:
            return
        for uuid in ended.allocation.uuids:
            if uuid in self.mps.devices() and not any(
                    j.id != ended.id and j.state in ACTIVE_STATES and j.allocation is not None
                    and uuid in j.allocation.uuids for j in self.active_jobs()):
                self._spawn(self._stop_mps(uuid))

    async def _stop_mps(self, uuid: str) -> None:
        try:
            await asyncio.to_thread(self.mps.stop, uuid)
        except GpuError as exc:
            log.warning("stopping the MPS control daemon of %s: %s", uuid, exc.message)

    async def _mps_env(self, allocation: Allocation) -> dict[str, str]:
        """For a share on an `mps` device: start (or reuse) its control daemon and give the job its caps."""
        if allocation.share is None or len(allocation.devices) != 1:
            return {}
        uuid = allocation.devices[0].uuid
        if self.share_modes().get(uuid) != "mps":
            return {}
        daemon = await asyncio.to_thread(self.mps.ensure, uuid)
        percent = max(1, min(100, round(allocation.share * 100)))
        return daemon.client_env(percent, allocation.gpu_mem_mib)

    async def _reap(self, job_id: int) -> None:
        status = await self.executor.wait(job_id)
        if status is not None:
            self._finish(job_id, status)

    def _poll_adopted(self) -> None:
        """Jobs re-adopted after a restart are not our children: look for their status each tick."""
        for job in self.active_jobs():
            if self.executor.owns(job.id):
                continue
            status = self.executor.collect(job.id)
            if status is not None:
                self._finish(job.id, status)
            elif not self.executor.is_alive(job.id):
                self._set(job, JobState.LOST, "job supervisor vanished without recording an exit status",
                          ended_at=self.clock())

    async def _recover(self) -> None:
        """Explicit restart rules: collect what ended, re-adopt what runs, LOST only what we cannot know."""
        for job in list(self.jobs.values()):
            if job.state is JobState.STARTING:
                status = self.executor.collect(job.id)
                if status is not None:
                    self._finish(job.id, status)
                elif self.executor.is_alive(job.id):
                    job = self._set(job, JobState.RUNNING, "re-adopted after daemon restart",
                                    pid=self.executor.adopted_pid(job.id))
                    if job.id in self._stops:
                        self._request_stop(job, self._stops[job.id])
                else:
                    self._set(job, JobState.LOST, "daemon stopped while the job was starting",
                              ended_at=self.clock())
            elif job.state in (JobState.RUNNING, JobState.SUSPENDED):
                status = self.executor.collect(job.id)
                if status is not None:
                    self._finish(job.id, status)
                elif not self.executor.is_alive(job.id):
                    self._set(job, JobState.LOST, "job ended while the daemon was down and left no status",
                              ended_at=self.clock())
                elif job.id in self._stops:
                    self._request_stop(job, self._stops[job.id])
            elif job.state is JobState.PREEMPTED:
                self._set(job, JobState.PENDING, "requeued after preemption")

    def _finish(self, job_id: int, status: ExitStatus) -> None:
        job = self.jobs.get(job_id)
        if job is None or job.state in TERMINAL_STATES:
            return
        timer = self._kill_timers.pop(job_id, None)
        if timer is not None:
            timer.cancel()
        stop = self._stops.pop(job_id, None)
        self._persist_stops()
        self._release_mps(job)
        if self.cgroups is not None and not self.cgroups.remove(job_id):
            log.warning("job %d: cgroup %s still has processes; left in place", job_id, self.cgroups.job_path(job_id))
        ended = status.ended_at or self.clock()
        fields = {"exit_code": status.exit_code, "signal": status.signal, "ended_at": ended}
        if status.error:
            self._set(job, JobState.FAILED, f"could not start: {status.error}", **fields)
        elif stop is not None and stop.final is JobState.PREEMPTED:
            job = self._set(job, JobState.PREEMPTED, stop.reason, **fields)
            self._set(job, JobState.PENDING, "requeued after preemption", allocation=None, pid=None,
                      started_at=None, ended_at=None, exit_code=None, signal=None)
        elif stop is not None:
            self._set(job, stop.final, stop.reason, **fields)
        elif status.signal is not None:
            self._set(job, JobState.FAILED, f"killed by signal {_signame(status.signal)}", **fields)
        elif status.exit_code == 0:
            self._set(job, JobState.COMPLETED, "exit code 0", **fields)
        else:
            self._set(job, JobState.FAILED, f"exit code {status.exit_code}", **fields)
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
            if job.state is JobState.SUSPENDED:
                self.executor.signal(job.pid, signal.SIGCONT)  # a stopped job cannot handle SIGTERM
            self.executor.signal(job.pid, signal.SIGTERM)
            loop = asyncio.get_running_loop()
            self._kill_timers[job.id] = loop.call_later(self.config.kill_grace_s, self._kill_hard, job.id, job.pid)

    def _kill_hard(self, job_id: int, pid: int) -> None:
        """The grace period is over: SIGKILL the process group, and the cgroup for anything that escaped it."""
        self.executor.signal(pid, signal.SIGKILL)
        if self.cgroups is not None:
            self.cgroups.kill(job_id)

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

    def _persist_standing(self) -> None:
        """Each user's place (lag, service) survives restarts and crashes."""
        export = getattr(self.scheduler, "export_standing", None)
        if callable(export):
            self.store.set_meta("standing", json.dumps(export()))

    def _persist_stops(self) -> None:
        self.store.set_meta(
            "stop_requests", json.dumps({str(k): [v.final.value, v.reason] for k, v in self._stops.items()})
        )

    # ---- bookkeeping ---------------------------------------------------------------------------

    def _set(self, job: Job, state: JobState, reason: str, **fields: object) -> Job:
        updated = self.store.transition(job, state, now=self.clock(), reason=reason, **fields)
        if state in TERMINAL_STATES:
            self.jobs.pop(job.id, None)
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
        if (job.state in ACTIVE_STATES) != (state in ACTIVE_STATES):
            self._write_job_mapping()
        self._notify()
        return updated

    def _count_waiting(self, job: Job, delta: int) -> None:
        for counts, step in ((self._waiting_by_uid, delta), (self._waiting_bytes_by_uid, delta * spec_bytes(job.spec))):
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
        self._spawn(self._notify_all())

    async def _notify_all(self) -> None:
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


def _signame(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)
