"""Handlers of requests about jobs: submit, queue, show, cancel, logs, wait, suspend, resume, hold,
release."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gpusched.arrayspec import compress
from gpusched.daemon.arraystore import ArrayRow
from gpusched.daemon.handlers_common import (
    CANCEL_CHUNK,
    REPLY_BUDGET,
    Context,
    _complete_utf8,
    _current,
    _find,
    _JobRef,
    _log_size,
    _read,
    _read_log,
    _redact,
    _ref,
    _require_owner,
    _summary_of_row,
    _task_job,
    _unique,
    summarize,
)
from gpusched.daemon.store import SummaryRow
from gpusched.model import (
    ACTIVE_STATES,
    TERMINAL_STATES,
    WAITING_STATES,
    Job,
    JobState,
    describe_request,
    display_name,
)
from gpusched.policy import Estimates, fairness_order
from gpusched.protocol import (
    ArraySummary,
    CancelRequest,
    CancelResult,
    ErrorCode,
    HoldRequest,
    JobsChanged,
    JobSummary,
    LogsRequest,
    LogsResult,
    ProtocolError,
    QueueRequest,
    QueueResult,
    ReleaseRequest,
    ResumeRequest,
    RuntimeEstimate,
    ShowRequest,
    ShowResult,
    SubmitRequest,
    SubmitResult,
    SuspendRequest,
    WaitRequest,
    WaitResult,
)


async def submit(ctx: Context, req: SubmitRequest) -> SubmitResult:
    if ctx.engine.config.mode == "slurm-node":  # one queue per GPU: Slurm's (docs/slurm.md)
        raise ProtocolError(ErrorCode.INVALID_STATE,
                            "this node runs gpuschedd in slurm-node mode: Slurm owns the queue, gpusched only "
                            "manages the GPUs", "submit with Slurm instead, e.g. `sbatch --gres=gpu:1g.10gb:1 job.sh`")
    return await ctx.engine.submit(uid=ctx.peer.uid, gid=ctx.peer.gid, user=ctx.user, spec=req.spec, hold=req.hold,
                                   array=req.array, request_id=req.request_id)


async def queue(ctx: Context, req: QueueRequest) -> QueueResult:
    after = req.after_id if req.after_id is not None else 0
    # An array is one row (its tasks counted by state) unless its tasks are asked for, or a script
    # pages through every job in id order (after_id): then each task is a row of its own.
    compact = not req.array_tasks and req.after_id is None
    live: dict[int, Job] = {}
    array_tasks: dict[int, list[Job]] = {}
    jobs = ctx.engine.jobs
    if req.user is None and not after and not (compact and ctx.engine.arrays.by_id):
        live = dict(jobs)  # everyone's, no array to fold: a copy in C (a restart's first `queue` at 100k jobs)
    else:
        for j in jobs.values():
            if (req.user is None or j.user == req.user) and j.id > after:
                if compact and j.array_id is not None:
                    array_tasks.setdefault(j.array_id, []).append(j)
                else:
                    live[j.id] = j
    stored: list[SummaryRow] = []
    finished_total = 0  # finished rows that matched, listed or not (`total` counts them all)
    if req.all and req.after_id is not None:  # paging through everything in id order after the cursor
        stored = await _read(ctx, lambda r: r.summaries(limit=req.limit, after_id=req.after_id, user=req.user))
    elif req.all:
        # Finished array tasks are counted in their array's row, so they must not take the rows left.
        stored, finished_total = await _read(ctx, lambda r: (
            r.summaries(limit=max(0, req.limit - len(live)), user=req.user, finished=True, tasks=not compact)
            if len(live) < req.limit else [],
            r.count_summaries(user=req.user, finished=True, tasks=not compact)))
    finished = {row.id: row for row in stored if row.id not in live}
    ended_arrays: set[int] = set()
    if compact and req.all:  # arrays whose tasks have all ended are listed too, the newest first
        ended_arrays = set(await _read(ctx, lambda r: r.newest_arrays(limit=req.limit, user=req.user)))
    arrays = await _array_summaries(ctx, array_tasks, ended_arrays) if array_tasks or ended_arrays else []
    ordered = sorted([*live, *finished])
    # (a policy with no such order lists its pending jobs in submission order: gpusched/policy.py)
    order = fairness_order(ctx.engine.scheduler) if req.order == "fairness" else None
    if order is not None:
        rank = {job_id: i for i, job_id in enumerate(order)}
        # Active and finished jobs first (by id), then pending ones as the scheduler would start them,
        # then those it does not hold yet (held, waiting for --after, held back by an array's %MAX).

        def place(i: int) -> tuple[int, int, int]:
            if i in rank:
                return (1, rank[i], i)
            waiting = i in live and live[i].state in WAITING_STATES
            return (2 if waiting else 0, 0, i)

        ordered.sort(key=place)
    rows: list[JobSummary] = []
    size = 0
    for job_id in ordered[: req.limit]:
        row = summarize(live[job_id]) if job_id in live else _summary_of_row(finished[job_id])
        size += len(row.model_dump_json().encode()) + 1
        if size > REPLY_BUDGET:
            break
        rows.append(row)
    # Array rows count against the same limit and reply size, after the jobs: one user's thousands of
    # arrays must not make the reply too large to send, nor push everyone else's jobs out of it.
    listed: list[ArraySummary] = []
    for summary in arrays[: max(0, req.limit - len(rows))]:
        size += len(summary.model_dump_json().encode()) + 1
        if size > REPLY_BUDGET:
            break
        listed.append(summary)
    return QueueResult(jobs=rows, total=max(len(ordered), len(live) + finished_total), arrays=listed,
                       arrays_total=len(arrays) if len(listed) < len(arrays) else None)


async def _array_summaries(ctx: Context, live: dict[int, list[Job]], ended: set[int]) -> list[ArraySummary]:
    """One row per array: its unfinished tasks from memory, its counts by state from the store."""
    ids = sorted(set(live) | ended)
    rows, counts = await _read(ctx, lambda r: (r.arrays(ids), r.array_counts(ids)))
    return [_array_summary(rows[i], counts.get(i, {}), live.get(i, [])) for i in ids if i in rows]


def _array_summary(row: ArrayRow, counts: dict[str, int], live: list[Job]) -> ArraySummary:
    waiting = sorted(j.array_task for j in live if j.state in WAITING_STATES and j.array_task is not None)
    return ArraySummary(
        id=row.id, name=display_name(row.spec), user=row.user, uid=row.uid, request=describe_request(row.spec.request),
        submitted_at=row.submitted_at, spec=row.tasks, tasks=row.task_count, max_running=row.max_running,
        states=dict(sorted(counts.items())), pending=compress(waiting),
    )


def show(ctx: Context, req: ShowRequest) -> ShowResult:
    array = None
    if req.task is not None:
        job = _find(ctx, _task_job(ctx, req.job_id, req.task))
    elif ctx.engine.get(req.job_id) is None and (row := ctx.engine.store.arrays([req.job_id]).get(req.job_id)):
        ids = ctx.engine.store.task_ids(row.id)
        first = next((i for i in ids if i in ctx.engine.jobs), ids[-1] if ids else None)
        if first is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"job array {row.id} has no tasks left")
        job = _find(ctx, first)
    else:
        job = _find(ctx, req.job_id)
    if job.array_id is not None:
        row = ctx.engine.store.arrays([job.array_id]).get(job.array_id)
        if row is not None:
            live = [j for j in ctx.engine.jobs.values() if j.array_id == row.id]
            array = _array_summary(row, ctx.engine.store.array_counts([row.id]).get(row.id, {}), live)
    return ShowResult(
        job=_redact(ctx, job), array=array, waiting_reason=ctx.engine.waiting_reason(job),
        log_path=ctx.engine.executor.log_path(job.id), events=ctx.engine.store.events(job_id=job.id),
        estimate=_estimate(ctx, job),
    )


def _estimate(ctx: Context, job: Job) -> RuntimeEstimate | None:
    """Run-time estimate, expected start (pending) or end (running), when the scheduler makes them."""
    sched = ctx.engine.scheduler
    if job.state not in (JobState.PENDING, *ACTIVE_STATES) or not isinstance(sched, Estimates):
        return None
    est = sched.estimate(job)
    if job.state is JobState.PENDING:
        start = sched.expected_start(job.id)
        return RuntimeEstimate(runtime_s=est.seconds, source=est.source,
                               expected_start_at=start)
    end = sched.expected_end(job.id)
    return RuntimeEstimate(runtime_s=est.seconds, source=est.source,
                           expected_end_at=end)


async def cancel(ctx: Context, req: CancelRequest) -> CancelResult:
    ids: list[int] = []
    arrays: list[int] = []
    for job_id in _unique(req.job_ids):
        if job_id in ctx.engine.jobs or ctx.engine.store.owner(job_id) is not None:
            ids.append(job_id)
            continue
        row = ctx.engine.store.arrays([job_id]).get(job_id)
        if row is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no job {job_id}", "`gpusched queue --all` lists known jobs")
        _require_owner(ctx, _JobRef(row.id, row.uid, row.user, JobState.PENDING, None), "cancel")
        arrays.append(row.id)
        # Highest first: the tasks %MAX holds back go before the queued ones, so none is released in between.
        ids += reversed(ctx.engine.store.task_ids(row.id, unfinished=True))
    ids += [_task_job(ctx, t.array_id, t.task) for t in req.tasks]
    refs = [_ref(ctx, job_id) for job_id in _unique(ids)]  # all-or-nothing: check every id first
    for ref in refs:
        _require_owner(ctx, ref, "cancel")
    cancelled, finished = [], []
    for start in range(0, len(refs), CANCEL_CHUNK):
        if start:
            await asyncio.sleep(0)  # between chunks the loop serves everyone else
        with ctx.engine.batch():  # one COMMIT per chunk, not one per job (an array has 10,000)
            for ref in refs[start : start + CANCEL_CHUNK]:
                by = "" if ref.uid == ctx.peer.uid else f" by {ctx.user}"
                if ref.job is not None and await ctx.engine.cancel(ref.job, f"cancelled{by}"):
                    cancelled.append(ref.id)
                else:
                    finished.append(ref.id)
    return CancelResult(cancelled=sorted(cancelled), already_finished=sorted(finished), arrays=arrays)


async def logs(ctx: Context, req: LogsRequest) -> LogsResult:
    job = _ref(ctx, req.job_id if req.task is None else _task_job(ctx, req.job_id, req.task))  # owner, not spec
    _require_owner(ctx, job, "read the log of")
    path = ctx.engine.executor.log_path(job.id)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + req.wait_s
    while True:
        finished = _current(ctx, job.id).state in TERMINAL_STATES
        raw = data = _read_log(path, req.offset, req.max_bytes)
        # Never split a character across two replies: only the end of a finished job's log may end
        # in a partial one (nothing will complete it). Trimmed before deciding to answer, or a job
        # whose output ends mid-character would have `logs -f` asking again and again for nothing.
        if not (finished and req.offset + len(raw) >= _log_size(path)):
            data = _complete_utf8(raw)
            if not data and len(raw) >= req.max_bytes:  # a character longer than the bytes asked for
                data = raw
        if data or finished or loop.time() >= deadline or ctx.engine.shutting_down:
            break
        # Log growth is not an engine event; a short poll inside the daemon keeps the client simple.
        await asyncio.sleep(min(0.1, max(0.0, deadline - loop.time())))
    next_offset = req.offset + len(data)
    eof = finished and _log_size(path) <= next_offset
    return LogsResult(data=data.decode("utf-8", errors="replace"), next_offset=next_offset, eof=eof)


async def wait(ctx: Context, req: WaitRequest) -> WaitResult:
    job_id = req.job_id if req.task is None else _task_job(ctx, req.job_id, req.task)
    _find(ctx, job_id)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + req.timeout_s
    while True:
        job = _current(ctx, job_id)
        remaining = deadline - loop.time()
        if job.state in TERMINAL_STATES or remaining <= 0 or ctx.engine.shutting_down:
            return WaitResult(job=_redact(ctx, job), finished=job.state in TERMINAL_STATES)
        await ctx.engine.wait_for_change(remaining)


async def suspend(ctx: Context, req: SuspendRequest) -> JobsChanged:
    return await _each(ctx, _with_tasks(ctx, req), "suspend", lambda job, why: ctx.engine.suspend(job, why),
                       "suspended")


async def resume(ctx: Context, req: ResumeRequest) -> JobsChanged:
    return await _each(ctx, _with_tasks(ctx, req), "resume", lambda job, why: ctx.engine.resume(job, why), "resumed")


async def hold(ctx: Context, req: HoldRequest) -> JobsChanged:
    return await _each(ctx, _with_tasks(ctx, req), "hold", lambda job, why: ctx.engine.hold(job, why), "held")


async def release(ctx: Context, req: ReleaseRequest) -> JobsChanged:
    return await _each(ctx, _with_tasks(ctx, req), "release", lambda job, why: ctx.engine.release(job, why), "released")


def _with_tasks(ctx: Context, req: SuspendRequest | ResumeRequest | HoldRequest | ReleaseRequest) -> list[int]:
    """The request's job ids, then the job id of each single task it names (`123_7`)."""
    return [*req.job_ids, *(_task_job(ctx, t.array_id, t.task) for t in req.tasks)]


async def _each(ctx: Context, job_ids: list[int], verb: str, act: Callable[[Job, str], str | None],
                past: str) -> JobsChanged:
    """Apply `act` to every job after checking all of them exist and are the caller's (all or nothing).

    Ids are deduplicated and checked by owner before anything is loaded: finished jobs are never
    loaded at all (nothing can change them), so a request's cost does not depend on others' specs.
    An array's id stands for its unfinished tasks; those not in the state `act` needs are left
    alone without a line each (an array has up to 10,000). As for `cancel`, one COMMIT per
    CANCEL_CHUNK jobs, with the loop serving others in between.
    """
    ids, arrays, tasks = _expand_arrays(ctx, job_ids, verb)
    refs = [_ref(ctx, job_id) for job_id in _unique(ids)]
    for ref in refs:
        _require_owner(ctx, ref, verb)
    changed, unchanged = [], {}
    for start in range(0, len(refs), CANCEL_CHUNK):
        if start:
            await asyncio.sleep(0)
        with ctx.engine.batch():
            for ref in refs[start : start + CANCEL_CHUNK]:
                by = "" if ref.uid == ctx.peer.uid else f" by {ctx.user}"
                # Read again: a job may have moved on, or ended, while the loop served others.
                job = ctx.engine.jobs.get(ref.id) if ref.job is not None else None
                if job is not None:
                    why_not = act(job, f"{past}{by}")
                else:
                    why_not = f"job is {ref.state}, it has ended" if ref.job is None else "job has ended"
                if why_not is None:
                    changed.append(ref.id)
                elif ref.id not in tasks:
                    unchanged[ref.id] = why_not
    return JobsChanged(changed=sorted(changed), unchanged=unchanged, arrays=arrays)


def _expand_arrays(ctx: Context, job_ids: list[int], verb: str) -> tuple[list[int], list[int], set[int]]:
    """(job ids with each array id replaced by its unfinished tasks, the arrays named, those tasks).

    `hold` takes an array's tasks highest first, as `cancel` does: holding a task frees its %MAX
    place, which must not go to a task about to be held."""
    ids: list[int] = []
    arrays: list[int] = []
    tasks: set[int] = set()
    for job_id in _unique(job_ids):
        if job_id in ctx.engine.jobs or ctx.engine.store.owner(job_id) is not None:
            ids.append(job_id)
            continue
        row = ctx.engine.store.arrays([job_id]).get(job_id)
        if row is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no job {job_id}", "`gpusched queue --all` lists known jobs")
        _require_owner(ctx, _JobRef(row.id, row.uid, row.user, JobState.PENDING, None), verb)
        arrays.append(row.id)
        members = ctx.engine.store.task_ids(row.id, unfinished=True)
        tasks.update(members)
        ids += reversed(members) if verb == "hold" else members
    return ids, arrays, tasks
