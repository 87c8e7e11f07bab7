"""The loop: events (submit, exit, tick) -> core plan -> actions carried out via gpu/ and the executor.

The engine holds the in-memory mirror of every unfinished job (the store holds the truth) and is
the only writer of job state. Handlers call its small public methods; they never touch processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable
from operator import attrgetter

from gpusched.config import DaemonConfig
from gpusched.core.scheduler import (
    Action,
    CreateInstance,
    DestroyInstance,
    FailJob,
    PreemptJob,
    ResumeJob,
    SetMigMode,
    SetPartitionMode,
    Snapshot,
    StartJob,
)
from gpusched.daemon.arrays import Arrays
from gpusched.daemon.cgroups import CgroupManager
from gpusched.daemon.checkpointing import Checkpoints
from gpusched.daemon.counters import Metrics
from gpusched.daemon.devices import DeviceManager
from gpusched.daemon.engine_batch import BatchMixin
from gpusched.daemon.engine_devices import DevicesMixin
from gpusched.daemon.engine_preempt import PreemptionMixin
from gpusched.daemon.engine_recovery import RecoveryMixin, _load_ids, _load_stops
from gpusched.daemon.engine_requests import RequestsMixin
from gpusched.daemon.executor import Executor
from gpusched.daemon.groupcommit import GroupCommit
from gpusched.daemon.launch import Launcher, LaunchFailed, allocation_env
from gpusched.daemon.readgate import ReadGate
from gpusched.daemon.recovery import StopRequest
from gpusched.daemon.standing import load_scheduler_state, save_scheduler_state
from gpusched.daemon.store import Store
from gpusched.gcpause import gc_paused
from gpusched.gpu.backend import Gpu, GpuBackend, GpuError, Inventory
from gpusched.model import (
    ACTIVE_STATES,
    Allocation,
    Event,
    Job,
    JobState,
    pending_since,
)
from gpusched.policy import Pins, Policy, submit_all

_HISTORY_EVERY_S = 60.0  # run-time history is saved at most this often (and at shutdown)
# A start hands a queue of more than HAND_OVER_LATER jobs to the scheduler after the socket opens, a
# chunk per turn of the loop (`_hand_over`): at 100k queued jobs that takes ~1 s, which the first
# answers need not wait for.
HAND_OVER_LATER = 5000
log = logging.getLogger("gpusched.engine")


class Engine(RequestsMixin, DevicesMixin, PreemptionMixin, RecoveryMixin, BatchMixin):
    """Owns job state transitions; wakes on events and on a tick. Its parts: engine_core (state and
    bookkeeping), engine_requests, engine_devices, engine_preempt, engine_recovery; here: start, stop,
    and the pass."""

    def __init__(
        self,
        config: DaemonConfig,
        store: Store,
        backend: GpuBackend,
        executor: Executor,
        scheduler: Policy,
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
            sim=config.sim is not None, state_dir=config.state_dir, moves=config.checkpoint_moves)
        self.jobs: dict[int, Job] = {}
        self._yielded: set[int] = set()  # shares the scheduler suspended in place (store meta `yielded`)
        self._history_saved_at = float("-inf")
        self.inventory = Inventory(gpus=())
        self._run_anchors: dict[int, tuple[int, float, float]] = {}  # time limits on the monotonic clock
        self.layouts_pending: set[int] = set()  # GPUs whose configured MIG layout waits for them to be idle
        self.last_seen: dict[int, Gpu] = {}  # every GPU an inventory has shown, as it was last (engine_devices)
        self.scheduler_gpus: tuple[Gpu, ...] = ()
        self._share_modes = None
        self._dynamic_gpus = None
        self._wake = asyncio.Event()
        self._changed = asyncio.Condition()
        self._notify_pending = False
        self._stops: dict[int, StopRequest] = {}
        # Final states of ended jobs that pending jobs depend on, looked up in the store once each;
        # only --after targets are cached, so it cannot grow with the number of jobs ever run.
        self._final_states: dict[int, JobState] = {}
        # ids of STARTING / RUNNING / SUSPENDED jobs, in the order they became active: the scheduler
        # updates its placement view when jobs that stay keep their order (core/cluster_sync.py);
        # listed by id, a job started after one with a higher id made it rebuild the view
        self._active: dict[int, None] = {}
        self._waiting_by_uid: dict[int, int] = {}  # PENDING + HELD jobs per uid (max_pending_per_user)
        self._waiting_bytes_by_uid: dict[int, int] = {}  # their spec_bytes (max_pending_bytes_per_user)
        self._submit_tokens: dict[int, tuple[float, float]] = {}  # uid -> (tokens, monotonic time)
        self._awaiting_deps: set[int] = set()  # PENDING jobs kept from the scheduler until --after is met
        self._held_with_deps: set[int] = set()  # HELD jobs with --after (a dependency may fail them)
        self._kill_timers: dict[int, asyncio.TimerHandle] = {}
        self.arrays = Arrays()  # job arrays with unfinished tasks: their environment and %MAX
        self.commits = GroupCommit(store)  # submits share COMMITs (daemon/groupcommit.py)
        self._requests: dict[tuple[int, str], asyncio.Future[tuple[int | None, list[Job]]]] = {}  # in flight
        self._handing: set[int] = set()  # pending jobs (array tasks, a start's queue) not yet handed to the scheduler
        self._arriving: asyncio.Task[None] | None = None  # a start's queue being handed over: no pass till done
        self._batch_log = None
        self.reads = ReadGate()  # big reads of the store, one per user at a time (readgate.py)
        self._tasks: set[asyncio.Task[None]] = set()
        self._gpu_state_moves: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self.passes = 0
        self.ended_unsaved = False  # a job ended since the standing was last saved
        self.shutting_down = False

    async def start(self) -> None:
        """Load unfinished jobs, recover running ones, read the GPUs, and start the loop."""
        await self.refresh_inventory()
        load_scheduler_state(self.store, self.scheduler)  # standing, preemption budgets, run-time history
        # A load allocates millions of objects and frees none: no cyclic collections meanwhile
        # (gcpause.py; the daemon's main then freezes what was loaded).
        with gc_paused():
            self._load_unfinished()
            # (a stop whose job's end was committed just before a crash is over)
            self._stops.update({i: stop for i, stop in _load_stops(self.store.get_meta("stop_requests")).items()
                                if i in self.jobs})
            self._yielded = {i for i in _load_ids(self.store.get_meta("yielded"))
                             if (j := self.jobs.get(i)) is not None and j.state is JobState.SUSPENDED}
            await self._recover()
            await self._repair_checkpoints()  # a checkpoint the last daemon began and never recorded
            # Only now: the jobs re-adopted just above hold instances that a new `mig = [...]` must
            # not destroy (busy_devices() knows them from here on).
            await self.apply_static_layouts()
            self.requeue_all(later=True)
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
        if self._gpu_state_moves:
            # A checkpoint or restore cut off halfway leaves the job's processes locked or checkpointed
            # with nothing recorded: let them end (each cuda-checkpoint call has its own deadline).
            await asyncio.wait(set(self._gpu_state_moves), timeout=4 * self.config.checkpoint_timeout_s)
        for task in list(self._tasks):
            task.cancel()
        for timer in self._kill_timers.values():
            timer.cancel()
        self.executor.detach()
        self._persist_stops()
        self._persist_standing(final=True)

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
                    await self._check_suspended()
                    for device in self.devices.tick(self.clock()):
                        log.info("device %s back in service after its quiet period", device)
                    await self._watch_gpu_memory()
                    if self.layouts_pending:
                        await self.retry_layouts()
                self._enforce_time_limits()
                await self._pass()
            except Exception:  # the loop must survive a bad pass; the next event retries
                log.exception("scheduling pass failed")

    async def wait_for_change(self, timeout: float) -> None:
        """Block until any job changes state, the daemon starts shutting down, or the timeout passes."""
        if self.shutting_down:
            return
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout)

    def snapshot(self) -> Snapshot:
        if self._incremental:
            pending: tuple[Job, ...] = ()  # the scheduler holds its own queue (see _enqueue)
        else:
            pending = tuple(sorted((j for j in self.jobs.values() if j.state is JobState.PENDING and self._ready(j)
                                    and self.arrays.is_admitted(j)), key=lambda j: j.id))
        return Snapshot(
            gpus=self.scheduler_gpus,
            pending=pending,
            active=tuple(j for i in self._active if (j := self.jobs[i]).allocation is not None),
            unschedulable=self.devices.unschedulable(self.inventory),
            share_modes=self.share_modes(),
            dynamic=self.dynamic_gpus(),
            mps_owner=self._mps_owners(),
            reserved_interactive=self._reserved_interactive(),
            checkpoint=self.checkpoints.enabled,
            checkpoint_moves=self.checkpoints.moves,
            yielded=frozenset(self._yielded),
        )

    def requeue_all(self, *, later: bool = False) -> None:
        """Hand every pending job to a fresh scheduler, in submission order (start-up, reload), with
        the checkpointed ones pinned to the GPUs they may resume on. `later` (a start): a queue of more
        than HAND_OVER_LATER jobs is handed over from the loop once the caller returns, while the
        socket already answers (`_hand_over`); no pass runs until it is all in (`_pass`)."""
        self._handing.clear()  # jobs not handed over yet go now, with the others
        if self.config.mode == "slurm-node":
            self._fail_local_queue()  # Slurm owns this node's queue: one source of truth per GPU
            return
        ready: list[Job] = []  # handed over at once below (policy.submit_all)
        queued: list[Job] = []  # every pending job, in id order
        pending = JobState.PENDING
        for job in sorted(self.jobs.values(), key=attrgetter("id")):
            if job.state is pending:
                queued.append(job)
            elif self.checkpoints.holds(job) and (queue := self._queue) is not None:
                if isinstance(self.scheduler, Pins):
                    self.scheduler.pin(job.id, self.checkpoints.resume_devices(job.id, self.inventory))
                queue.submit(job)
            elif job.id in self.checkpoints.saved and job.state is JobState.SUSPENDED:
                self._spawn(self._restore(job), gpu_state=True)  # the daemon stopped while restoring it: finish that
                continue
        if later and len(queued) > HAND_OVER_LATER and self._queue is not None:
            self._handing.update(job.id for job in queued)
            self._arriving = self._spawn(self._hand_over([job.id for job in queued]))
        else:
            for job in queued:
                self._enqueue(job, ready)
            if ready and (queue := self._queue) is not None:
                submit_all(queue, ready)
        for job_id in [i for i, j in ((i, self.jobs.get(i)) for i in self.checkpoints.saved)
                       if j is None or j.state is not JobState.SUSPENDED]:
            self.checkpoints.forget(job_id)  # ended, or restored, while the daemon was down

    def _fail_local_queue(self) -> None:
        """In slurm-node mode: jobs queued before the switch (pending or held) would run on GPUs
        Slurm also hands out. They end FAILED with the reason, before the loop starts."""
        for job in sorted(self.jobs.values(), key=lambda j: j.id):
            if job.state in (JobState.PENDING, JobState.HELD):
                self._set(job, JobState.FAILED, "this node now runs gpuschedd in slurm-node mode: Slurm owns its "
                          "queue (submit the job with sbatch)", ended_at=self.clock())

    async def _pass(self) -> None:
        # While a start's queue is still being handed over, every job is listed and shown but nothing
        # is decided: a pass that saw part of the queue could start a later job ahead of an earlier
        # one of a user more owed. The handover's last chunk wakes the loop.
        if self._arriving is not None and not self._arriving.done():
            return
        self.passes += 1
        began = time.perf_counter()
        self._fail_broken_dependencies()
        self._release_met_dependencies()
        actions = self.scheduler.plan(self.snapshot(), self.clock())
        # (after a job's end too: the pass settled its charge, which a kill -9 must not lose)
        if actions or self.ended_unsaved or self.passes % 30 == 0:
            # With starts, which the standing charges: it rides on their STARTING commits (durable
            # with them, and no COMMIT of its own on each start's path); else a COMMIT of its own.
            starts = any(isinstance(a, StartJob) for a in actions)
            try:
                self._persist_standing(with_next_commit=starts)
            except Exception:  # (a full disk): the standing is saved again after the next pass
                log.exception("saving the fair-share standing failed")
        # The scheduler has taken these jobs off its queue: each action is carried out on its own, and
        # a start that could not even be recorded gives its job back, or it would wait for ever.
        for action in actions:
            try:
                await self._apply(action)
            except Exception:
                log.exception("carrying out %s failed", type(action).__name__)
                job = self.jobs.get(action.job_id) if isinstance(action, StartJob) else None
                if job is not None and job.state is JobState.PENDING:
                    self._enqueue(job)
        if self.store.meta_waiting:  # no start was recorded: the standing's own COMMIT, made durable
            try:                     # by the next ordinary one as before
                with self.store.unsynced():
                    self.store.commit_meta()
            except Exception:  # (it stays waiting: the next commit of any kind writes it)
                log.exception("committing the fair-share standing after a pass without starts failed")
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
                self._spawn(self._checkpoint(job, action.reason), gpu_state=True)
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
        elif isinstance(action, SetPartitionMode):
            await self._set_partition_mode(action)
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

    async def _start(self, action: StartJob) -> None:
        """Commit STARTING with the devices, then launch off the pass: nothing a job's user controls
        (everything between the shim's fork and the job's exec runs as that user) can stall it."""
        job = self.jobs.get(action.job_id)
        if job is not None and self.checkpoints.holds(job):
            # Held from now on. Its processes keep the environment they were launched with (a move
            # changes the GPUs behind its UUIDs, not its environment), so that is what `show` lists.
            allocation = action.allocation.model_copy(update={"env": self.checkpoints.launch_env(job.id)})
            self.checkpoints.restoring_to(job.id, allocation.uuids)
            job = self.jobs[job.id] = self.store.update(job, allocation=allocation)
            self._write_job_mapping()  # it may be restored on other devices: they are its now
            self._spawn(self._restore(job), gpu_state=True)
            return
        if job is None or job.state is not JobState.PENDING:
            return
        now = self.clock()
        self.metrics.observe_wait(now - pending_since(job))
        try:
            try:
                added = allocation_env(job, action.allocation, self.config, self.inventory.gpus) | (
                    await self.launcher.share_env(job.id, action.allocation, self.share_modes(), job.uid)
                ) | self.arrays.env(job)
            except GpuError as exc:
                self._set(job, JobState.FAILED, f"could not start MPS for its device: {exc.message}", ended_at=now)
                return
            allocation = action.allocation.model_copy(update={"env": added})  # `show` lists what the job got
            job = self._set(job, JobState.STARTING, action.reason, allocation=allocation, started_at=now)
        finally:
            self.launcher.mps_started(action.allocation, job.uid)  # active now (or not starting at all)
        self._spawn(self._launch(job, allocation, added))

    async def _launch(self, job: Job, allocation: Allocation, added: dict[str, str]) -> None:
        """Start the job's shim (with the launch deadline), record RUNNING, then reap it."""
        try:
            started = await self.launcher.start(job, allocation, added, self.inventory, self.config.launch_timeout_s,
                                                on_pid=lambda pid: self._on_pid(job.id, pid))
        except LaunchFailed as exc:
            current = self.jobs.get(job.id)
            if current is not None and current.state is JobState.STARTING:
                self._end(current, JobState.FAILED, str(exc), ended_at=self.clock())
            self._cleanup(job.id, current)
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

    def _on_pid(self, job_id: int, pid: int) -> None:
        """The shim has forked the job: a stop requested meanwhile can reach it now (even unexec'd)."""
        job = self.jobs.get(job_id)
        if job is not None and job.state is JobState.STARTING:
            # No fsync: the RUNNING commit that follows the exec makes it durable, and until then a
            # power loss ends the job whatever the store says; its fsync held up reading the exec.
            with self.store.unsynced():
                job = self.jobs[job_id] = self.store.update(job, pid=pid)
            if job_id in self._stops:
                self._signal_stop(job)

    async def _reap(self, job_id: int) -> None:
        status = await self.executor.wait(job_id)
        if status is not None:
            self._finish(job_id, status)

    def _persist_standing(self, *, final: bool = False, with_next_commit: bool = False) -> None:
        """What the scheduler learned and counted survives restarts and crashes (standing.py); the run
        times at most once a minute (they can be megabytes) and at shutdown. `with_next_commit`: in
        whatever the store commits next (Store.meta_with_next_commit), else now."""
        now = self.clock()
        history = final or now - self._history_saved_at >= _HISTORY_EVERY_S
        save_scheduler_state(self.store, self.scheduler, history=history, with_next_commit=with_next_commit)
        self.ended_unsaved = False
        if history:
            self._history_saved_at = now
