"""The engine's answers to handlers: submit (with group commit and arrays), cancel, suspend,
resume, hold, release, and why a job waits. Each checks, commits, then wakes the loop."""

from __future__ import annotations

import asyncio
import grp
import logging
import os
import pwd
import signal
import sqlite3
import time

from gpusched.arrayspec import ArraySpec, ArraySpecError, parse_array_spec
from gpusched.construct import construct, fields_of
from gpusched.core.fairshare import FairShare
from gpusched.core.scheduler import unsatisfiable_reason
from gpusched.daemon.arraystore import KnownRequest
from gpusched.daemon.engine_core import EngineCore
from gpusched.daemon.groupcommit import Write
from gpusched.daemon.recovery import StopRequest
from gpusched.daemon.startup import scheduler_config
from gpusched.model import (
    TERMINAL_STATES,
    Job,
    JobSpec,
    JobState,
    spec_bytes,
)
from gpusched.policy import NO_EXPLANATION, SharesFairly, explanation, submit_all
from gpusched.protocol import ErrorCode, ProtocolError, SubmitResult

log = logging.getLogger("gpusched.engine")
# Pending jobs handed to the scheduler after the fact (an array's tasks, a start's long queue) go
# over this many per turn of the loop (a few ms each), so other clients are answered meanwhile.
HAND_OVER_CHUNK = 500


class RequestsMixin(EngineCore):
    """Requests from handlers."""

    async def submit(self, *, uid: int, gid: int, user: str, spec: JobSpec, hold: bool = False,
                     array: str | None = None, request_id: str | None = None) -> SubmitResult:
        """Validate against this node, commit (one COMMIT shared with the submits that arrive with it),
        then wake the loop. Returns once the job, or the array and all its tasks, is durable; raises
        ProtocolError. A `request_id` seen before returns what it created, and creates nothing."""
        if request_id is not None and (uid, request_id) in self._requests:  # its first attempt is being committed
            return await self._pending_request(uid, request_id)
        try:
            array_id, jobs = await self._write_submit(uid=uid, gid=gid, user=user, spec=spec, hold=hold, array=array,
                                                      request_id=request_id)
            return _submitted(array_id, jobs, duplicate=False)
        except (ProtocolError, KnownRequest) as exc:
            # A request_id used before answers with what it created, whatever this attempt met (a limit
            # its own first attempt now fills, say). Looked up only here: a submit's key is checked by
            # the table's primary key when it is written (arraystore.insert_submit_key).
            known = self._stored_request(uid, request_id) if request_id is not None else None
            if known is not None:
                return known
            if isinstance(exc, KnownRequest):  # its job was pruned between the write and this lookup
                raise ProtocolError(ErrorCode.INVALID_STATE, f"request_id {request_id} was used before, and "
                                    "what it created is no longer kept", "submit with a new request_id") from None
            raise
        except (OSError, sqlite3.Error) as exc:
            raise ProtocolError(ErrorCode.INTERNAL, f"the job could not be stored: {exc}",
                                "nothing was queued; see the daemon's log") from None

    def _write_submit(self, *, uid: int, gid: int, user: str, spec: JobSpec, hold: bool, array: str | None,
                      request_id: str | None) -> asyncio.Future[tuple[int | None, list[Job]]]:
        """Check the submit against this node and its user's limits, and queue its write for the next
        COMMIT; the future resolves to (array id, jobs) once that is durable. A plain function, not a
        coroutine: one coroutine fewer per submit."""
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
        for dep in spec.after:  # a job, or an array (its id waits for all its tasks)
            if self.get(dep.job_id) is None and dep.job_id not in self.store.arrays([dep.job_id]):
                raise ProtocolError(ErrorCode.NOT_FOUND, f"after: no job {dep.job_id} to depend on")
        # Counted now, not at the commit: submits waiting for the same COMMIT must not pass the limits together.
        self._reserve(uid, count, size)
        now = self.clock()

        def apply() -> tuple[int | None, list[Job]]:
            if tasks is None:
                return None, [self.store.submit(uid=uid, gid=gid, user=user, spec=spec, now=now, hold=hold,
                                                request_id=request_id, size=size)]
            return self.store.submit_array(uid=uid, gid=gid, user=user, spec=spec, now=now, array=tasks, hold=hold,
                                           request_id=request_id)

        write = Write(apply=apply, committed=lambda done: self._accepted(done, tasks),
                      failed=lambda exc: self._reserve(uid, -count, -size))
        future = self.commits.write(write)
        if request_id is not None:
            self._requests[(uid, request_id)] = future
            future.add_done_callback(lambda _: self._requests.pop((uid, request_id), None))
        return future

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
        """Jobs in `_handing` reach the scheduler HAND_OVER_CHUNK at a time, after the caller returned:
        an array's tasks once its answer went out (10,000 scheduler inserts in one go would hold the
        loop, and every other client, for ~0.2 s), a start's long queue once the socket answers
        (Engine.requeue_all). A job that left PENDING meanwhile (cancelled, held) was taken out of
        `_handing` by its change and is skipped, and so is the rest once a requeue_all (a reload)
        has handed everything over itself."""
        for start in range(0, len(ids), HAND_OVER_CHUNK):
            await asyncio.sleep(0)
            ready: list[Job] = []
            for job_id in ids[start : start + HAND_OVER_CHUNK]:
                job = self.jobs.get(job_id)
                if job_id in self._handing and job is not None and job.state is JobState.PENDING:
                    self._handing.discard(job_id)
                    self._enqueue(job, ready)  # (its dependencies and its array's %MAX, as one at a time)
            if ready and (queue := self._queue) is not None:
                submit_all(queue, ready)
        self.wake()

    async def _pending_request(self, uid: int, request_id: str) -> SubmitResult:
        """What the first submit with this request_id created, once it is committed (or its error)."""
        array_id, jobs = await asyncio.shield(self._requests[(uid, request_id)])
        return _submitted(array_id, jobs, duplicate=True)

    def _stored_request(self, uid: int, request_id: str) -> SubmitResult | None:
        """What an earlier, committed submit with this request_id created, if its key is still kept."""
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
        if len(job.history) >= MAX_REQUESTED_CHANGES:
            return _too_many_changes(job)
        if job.state is not JobState.RUNNING or not job.pid:
            return f"job is {job.state}, not RUNNING"
        if job.id in self._stops:
            return "job is already being stopped"
        if job.id in self.checkpoints.underway:
            # (a suspend now would leave its CUDA state checkpointed under a job that keeps its GPU)
            return "job is being checkpointed to give its GPU to another job; try again in a moment"
        self.executor.signal(job.pid, signal.SIGSTOP)
        self._set(job, JobState.SUSPENDED, f"{reason}; still holds its devices and GPU memory")
        return None

    def resume(self, job: Job, reason: str) -> str | None:
        job = self.jobs.get(job.id, job)
        if job.state is not JobState.SUSPENDED or not job.pid:
            return f"job is {job.state}, not SUSPENDED"
        if self.checkpoints.holds(job):
            return "job is checkpointed (its GPU was given to another job); it resumes when the scheduler gives it back"
        if job.id in self.checkpoints.saved:  # given its GPU back: the restore is under way
            return "job is being restored from its checkpoint; it runs again once its GPU state is back"
        if job.id in self._yielded:
            return ("job was suspended in place for another job; it resumes when its compute is free again "
                    "(the scheduler does it)")
        self.executor.signal(job.pid, signal.SIGCONT)
        self._set(job, JobState.RUNNING, reason)
        return None

    def hold(self, job: Job, reason: str) -> str | None:
        job = self.jobs.get(job.id, job)
        if len(job.history) >= MAX_REQUESTED_CHANGES:
            return _too_many_changes(job)
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

    def waiting_reason(self, job: Job) -> str | None:
        if job.state is JobState.HELD:
            return "held: `gpusched release` lets it start"
        if job.state is not JobState.PENDING:
            return None
        unmet = [d for d in job.spec.after if self._dependency_status(d) is None]
        if unmet:
            return "waiting for " + ", ".join(
                f"{self._dependency_name(d)} to {'complete' if d.condition == 'ok' else 'end'}" for d in unmet)
        info = self.arrays.by_id.get(job.array_id) if job.array_id is not None else None
        if info is not None and job.id in info.waiting:  # the scheduler has not got it yet
            return (f"waiting for array {info.id}'s %{info.max_running}: {len(info.admitted)} of its tasks are "
                    "queued or running; it is handed over when one of them ends")
        if job.id in self._handing:
            return "pending: being handed to the scheduler (the daemon started, or took the array, moments ago)"
        said = explanation(self.scheduler, job.id)
        if said is not None:
            return said
        ahead = sum(1 for j in self.jobs.values() if j.state is JobState.PENDING and j.id < job.id)
        return f"pending; {ahead} job(s) submitted before it are pending too ({NO_EXPLANATION})"

    def weight_of(self, user: str) -> float:
        """A user's fair-share weight as `top` and `stats` show it: the scheduler's own (a group
        member's share of the group's weight) for a user with work, else what they would have alone
        (their configured weight, or their group's)."""
        fair = self.scheduler.fair if isinstance(self.scheduler, SharesFairly) else self._configured_fairness()
        if fair.is_active(user):  # (an inactive member's own weight is its base one: not what it gets)
            return float(fair.weight(user))
        try:
            uid: int | None = pwd.getpwnam(user).pw_uid
        except KeyError:
            uid = int(user) if user.isdigit() else None
        return fair.weight_alone(user, uid)

    def _configured_fairness(self) -> FairShare:
        """For a policy without fair-share state: the weights `[fairness]` configures (nobody active)."""
        cached = getattr(self, "_fairness_for", None)
        if cached is None or cached[0] is not self.config:
            cached = self._fairness_for = (self.config, FairShare(scheduler_config(self.config).fairness))
        return cached[1]

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


_SUBMIT_RESULT_SET = fields_of(SubmitResult)


def _submitted(array_id: int | None, jobs: list[Job], *, duplicate: bool) -> SubmitResult:
    # Built from the store's own values, so not validated again (every submit is answered with one;
    # model_construct took 2.6 us of the ~70 us of the loop's time a submit takes at 16 clients).
    return construct(SubmitResult, _SUBMIT_RESULT_SET, {
        "job_id": jobs[0].id if array_id is None else array_id, "state": jobs[0].state,
        "tasks": None if array_id is None else len(jobs), "duplicate": duplicate})


# A job's history is kept whole (`show`, accounting), and each of its transitions stays in the
# reply: hold/release or suspend/resume cycles, which cost an owner nothing, would otherwise grow
# it until `show` and `wait` of the job no longer fit in a frame (20,000 took 6 s). The daemon's
# own transitions (start, end, requeue) are bounded by the preemption budget.
MAX_REQUESTED_CHANGES = 1000


def _too_many_changes(job: Job) -> str:
    return (f"job has changed state {len(job.history)} times; after {MAX_REQUESTED_CHANGES} it can no longer be "
            "held or suspended (its history must fit in a reply): cancel it and submit it again")
