"""Jobs the daemon did not start in this run, and jobs that must be stopped: the unfinished jobs
loaded at start, the restart rules (daemon/recovery.py) applied to each of them, adopted jobs
polled, exits recorded, time limits, GPU-memory limits in timeslice mode, and jobs continued by
someone else's SIGCONT."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sqlite3
import time

from gpusched.daemon.engine_core import EngineCore
from gpusched.daemon.executor import NEVER_LAUNCHED, ExitStatus, Trace
from gpusched.daemon.launch import describe, gpu_memory_by_job
from gpusched.daemon.procfs import is_running, session_states
from gpusched.daemon.recovery import QUIET_UNLAUNCHED, StopRequest, Verdict, decide, fallback, outcome
from gpusched.gpu.backend import GpuError
from gpusched.model import (
    ACTIVE_STATES,
    TERMINAL_STATES,
    Job,
    JobState,
    run_seconds,
)
from gpusched.policy import ChargesDowntime

log = logging.getLogger("gpusched.engine")

SUSPEND_SETTLE_S = 0.5  # how long after a suspend its SIGSTOP must show in /proc


class RecoveryMixin(EngineCore):
    """Restart rules, exits and the per-tick checks."""

    def _poll_adopted(self) -> None:
        """Jobs re-adopted after a restart are not our children: apply the restart rules each tick."""
        for job in self.active_jobs():
            if not self.executor.owns(job.id) and job.id not in self.launcher.in_flight:
                self._recover_job(job)

    def _load_unfinished(self) -> None:
        """The in-memory mirror of every unfinished job, its array and its user's waiting counts."""
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
                self._active[job.id] = None
                self.arrays.mark_active(job)
            elif job.state is JobState.HELD and job.spec.after:
                self._held_with_deps.add(job.id)
        # The per-user limit counts (what _count_waiting keeps up to date from here on), summed by SQLite:
        # measuring 100k specs was a tenth of a restart.
        for uid, (count, size) in self.store.waiting_totals().items():
            self._waiting_by_uid[uid] = count
            self._waiting_bytes_by_uid[uid] = size

    async def _recover(self) -> None:
        """Explicit restart rules (daemon/recovery.py) for every unfinished job; none can stop the start."""
        launched = self.executor.launched()
        # Shares found holding an MPS device: their users' control daemons are known again before
        # any of them is ended below, so the end quits (or re-caps) the daemon as it would have; the
        # daemons no share holds had their shares end while no gpuschedd was there to quit them.
        modes = self.share_modes()
        for job in self.active_jobs():
            if job.allocation is not None:
                self.launcher.adopt_mps(job.id, job.allocation, modes, job.uid)
        try:
            strays = await asyncio.to_thread(self.launcher.mps.quit_strays)
        except GpuError as exc:
            log.warning("quitting MPS control daemons left from before the restart: %s", exc.message)
        else:
            if strays:
                log.info("quit %d MPS control daemon(s) whose shares ended while gpuschedd was down", strays)
        was_active = [job.id for job in self.active_jobs()]
        for job in list(self.jobs.values()):
            if job.id in launched:
                self._recover_job(job)
            elif job.state not in QUIET_UNLAUNCHED:
                self._recover_job(job, NEVER_LAUNCHED)
        for job_id in was_active:  # ended while no daemon ran: their users are charged the downtime too
            ended = self.jobs.get(job_id) or self.store.get(job_id)
            if ended is not None and ended.state in TERMINAL_STATES and isinstance(self.scheduler, ChargesDowntime):
                self.scheduler.charge_ended_while_away(ended)
        for uuid, uid in self.launcher.mps.servers():  # caps as the shares that are still there
            if uid is not None:
                self._spawn(self.launcher.update_mps_caps(uuid, uid))

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
                    # It has run since its launch, not since now: its time limit counts from then.
                    job = self._set(job, JobState.RUNNING, rule.reason, at=job.started_at, pid=trace.pid)
                elif job.pid != trace.pid and trace.pid:
                    job = self.jobs[job.id] = self.store.update(job, pid=trace.pid)
                if job.id in self._stops:
                    self._request_stop(job, self._stops[job.id])
            elif rule.verdict is Verdict.REQUEUE:
                if job.state is JobState.STARTING and not self.executor.revoke(job.id):
                    return  # a shim took the launch after all: the next tick sees it run
                stop = self._stops.get(job.id)
                if stop is not None:  # cancelled (or its launch failed) while starting: it never ran, and ends so
                    self._end(job, stop.final, f"{stop.reason} (before its launch ran)", ended_at=self.clock())
                    self._cleanup(job.id, job)
                    return
                self._set(job, JobState.PENDING, rule.reason, allocation=None, pid=None, started_at=None,
                          ended_at=None, exit_code=None, signal=None)
            elif rule.verdict is Verdict.LOST:
                self._end(job, JobState.LOST, rule.reason, ended_at=self.clock())
                self._cleanup(job.id, job)
        except sqlite3.Error as exc:  # what happened could not be written (a full disk): not the job's fault
            log.error("job %d: cannot record it yet (%s); trying again at the next tick", job.id, exc)
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
        try:
            self._end(job, fallback(job.state), reason, ended_at=self.clock())
        except Exception:
            # (a full disk): it stays as it is, and the next tick's _poll_adopted tries again; a job
            # forgotten here stayed RUNNING in the store and vanished from the queue for good
            log.exception("job %d: cannot record its end yet; trying again at the next tick", job_id)
            return
        with contextlib.suppress(Exception):
            self._cleanup(job_id, job)

    def _finish(self, job_id: int, status: ExitStatus) -> None:
        job = self.jobs.get(job_id)
        if job is None or job.state in TERMINAL_STATES:
            return
        stop = self._stops.get(job_id)
        ended = status.ended_at or self.clock()
        fields: dict[str, object] = {"exit_code": status.exit_code, "signal": status.signal, "ended_at": ended}
        final, reason = outcome(status, stop)
        before = job
        job = self._end(job, final, reason, **fields)
        self._cleanup(job_id, before)
        if job.state is JobState.PREEMPTED:
            self._set(job, JobState.PENDING, "requeued after preemption", allocation=None, pid=None,
                      started_at=None, ended_at=None, exit_code=None, signal=None)
        self.wake()

    async def _check_suspended(self) -> None:
        """A SUSPENDED job's owner can SIGCONT it: a job that runs again is RUNNING, and its clock runs.

        Checked from /proc (every process of the job's session stopped, or dead) a moment after the
        suspend, so the SIGSTOP has certainly landed. The scan reads every process's stat, and a
        user with a suspended job can start 100k processes: it runs off the loop (1.2 s a tick there).
        """
        now = self.clock()
        suspended = {j.pid: j for j in self.active_jobs() if j.state is JobState.SUSPENDED and j.pid
                     and j.id not in self._stops and now - j.history[-1].at >= SUSPEND_SETTLE_S
                     and j.id not in self.checkpoints.saved}
        if not suspended:
            return
        for sid, states in (await asyncio.to_thread(session_states, suspended)).items():
            job = suspended[sid]
            # (only if nothing happened to it while /proc was read: every change replaces the object)
            if (is_running(states) and self.jobs.get(job.id) is job and job.id not in self._stops
                    and job.id not in self.checkpoints.saved):
                self._set(job, JobState.RUNNING, "continued by a signal gpusched did not send while "
                          "suspended; it runs again, and its time counts")

    def _enforce_time_limits(self) -> None:
        now = self.clock()
        for job in self.active_jobs():
            limit = job.spec.time_limit_s
            if job.state is JobState.RUNNING and limit is not None and job.id not in self._stops \
                    and self._run_time(job, now) > limit:
                # (not :g alone, which writes a 14-day limit as 1.2096e+06)
                shown = f"{limit:g}" if limit < 1e6 else f"{limit:.0f}"
                self._request_stop(job, StopRequest(JobState.TIMEOUT, f"time limit of {shown}s reached"))

    def _run_time(self, job: Job, now: float) -> float:
        """The job's running time for its limit: from its history (wall clock, which a restart
        needs) up to the first time this daemon measures it in its current state, then by the
        monotonic clock, so a step of the wall clock (NTP, `date -s`) neither ends a job early nor
        lets it run past --time. A change of state (a suspend, a requeue) measures it afresh."""
        mono = time.monotonic()
        anchor = self._run_anchors.get(job.id)
        if anchor is None or anchor[0] != len(job.history):
            base = run_seconds(job, now)
            self._run_anchors[job.id] = (len(job.history), mono, base)
            return base
        return anchor[2] + (mono - anchor[1])

    async def _watch_gpu_memory(self) -> None:
        """In `timeslice` mode nothing in the hardware caps memory: end a job that uses more than it asked."""
        modes = self.share_modes()
        watched = [j for j in self.active_jobs() if j.state is JobState.RUNNING and j.allocation is not None
                   and j.allocation.gpu_mem_mib is not None and j.id not in self._stops
                   and any(modes.get(u) == "timeslice" for u in j.allocation.uuids)]
        if not watched:
            return
        used = await asyncio.to_thread(gpu_memory_by_job, self.backend, watched, self.cgroups)
        for job in watched:
            limit = job.allocation.gpu_mem_mib if job.allocation is not None else None
            if limit is not None and used.get(job.id, 0) > limit:
                reason = f"gpu_mem exceeded: its processes use {used[job.id]} MiB, over its --gpu-mem of {limit} MiB"
                self._request_stop(job, StopRequest(JobState.FAILED, reason))


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
