"""One function per request: (ctx, request) -> result. Handlers never see a socket.

Identity comes from `ctx.peer` (SO_PEERCRED, filled in by the server), never from the payload.
Errors are raised as ProtocolError with a stable code; the server turns them into error frames.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from gpusched import __version__
from gpusched.arrayspec import compress
from gpusched.config import ConfigError
from gpusched.core.accounting import UserStats, device_busy_fraction, fairness_index, user_stats
from gpusched.core.scheduler import Scheduler
from gpusched.daemon.arraystore import ArrayRow
from gpusched.daemon.devices import DeviceError, simulator_of
from gpusched.daemon.doctor import run_checks
from gpusched.daemon.engine import Engine
from gpusched.daemon.launch import gpu_memory_by_job
from gpusched.daemon.store import StoreReader, SummaryRow
from gpusched.gpu.backend import GpuError
from gpusched.model import (
    ACTIVE_STATES,
    TERMINAL_STATES,
    WAITING_STATES,
    Job,
    JobState,
    bounded,
    describe_request,
    display_name,
)
from gpusched.protocol import (
    MAX_FRAME,
    PROTOCOL_VERSION,
    ArraySummary,
    CancelRequest,
    CancelResult,
    DevicesChanged,
    DeviceStatsInfo,
    DoctorRequest,
    DoctorResult,
    ErrorCode,
    GpuDrainRequest,
    GpuInfo,
    GpuResumeRequest,
    GpusRequest,
    GpusResult,
    HelloRequest,
    HelloResult,
    HoldRequest,
    InstanceInfo,
    JobsChanged,
    JobSummary,
    LogsRequest,
    LogsResult,
    MigApplyRequest,
    MigApplyResult,
    PlannedInstance,
    ProtocolError,
    QueueRequest,
    QueueResult,
    ReleaseRequest,
    ReloadRequest,
    ReloadResult,
    ResumeRequest,
    RuntimeEstimate,
    ShowRequest,
    ShowResult,
    ShutdownRequest,
    ShutdownResult,
    SimInjectXidRequest,
    SimResult,
    StatsRequest,
    StatsResult,
    SubmitRequest,
    SubmitResult,
    SuspendRequest,
    TopJob,
    TopSnapshot,
    TopUser,
    UserStatsInfo,
    WaitRequest,
    WaitResult,
    WatchRequest,
    check_version,
)

MAX_REASON = 256  # characters of a job's reason in listings; `show` has the whole history
CANCEL_CHUNK = 500  # jobs cancelled per COMMIT: a whole array must not hold the loop for its 10,000
# A listing stops adding rows at this many bytes, so its reply always fits in one frame (and says how
# many rows it left out) whatever the jobs' names and reasons hold.
REPLY_BUDGET = MAX_FRAME - 64 * 1024


_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Peer:
    """The kernel's word on who is at the other end of the socket."""

    pid: int
    uid: int
    gid: int


@dataclass(slots=True)
class Context:
    engine: Engine
    peer: Peer
    user: str
    admin: bool
    backend_name: str
    request_shutdown: Callable[[], None]
    socket_path: str = ""
    reload: Callable[[], Awaitable[ReloadResult]] | None = None


def hello(ctx: Context, req: HelloRequest) -> HelloResult:
    check_version(req.version)
    return HelloResult(
        version=PROTOCOL_VERSION, daemon_version=__version__, uid=ctx.peer.uid, user=ctx.user,
        admin=ctx.admin, backend=ctx.backend_name,
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
    for j in ctx.engine.jobs.values():
        if (req.user is None or j.user == req.user) and j.id > after:
            if compact and j.array_id is not None:
                array_tasks.setdefault(j.array_id, []).append(j)
            else:
                live[j.id] = j
    stored: list[SummaryRow] = []
    if req.all and req.after_id is not None:  # paging through everything in id order after the cursor
        stored = await _read(ctx, lambda r: r.summaries(limit=req.limit, after_id=req.after_id, user=req.user))
    elif req.all and len(live) < req.limit:
        # Finished array tasks are counted in their array's row, so they must not take the rows left.
        stored = await _read(ctx, lambda r: r.summaries(limit=req.limit - len(live), user=req.user, finished=True,
                                                        tasks=not compact))
    finished = {row.id: row for row in stored if row.id not in live}
    ended_arrays: set[int] = set()
    if compact and req.all:  # arrays whose tasks have all ended are listed too, the newest first
        ended_arrays = set(await _read(ctx, lambda r: r.newest_arrays(limit=req.limit, user=req.user)))
    arrays = await _array_summaries(ctx, array_tasks, ended_arrays) if array_tasks or ended_arrays else []
    ordered = sorted([*live, *finished])
    order = getattr(ctx.engine.scheduler, "fairness_order", None)
    if req.order == "fairness" and callable(order):
        rank = {job_id: i for i, job_id in enumerate(order())}
        # Active and finished jobs first (by id), then pending ones as the scheduler would start them.
        ordered.sort(key=lambda i: (i in rank, rank.get(i, 0), i))
    rows: list[JobSummary] = []
    size = sum(len(a.model_dump_json().encode()) + 1 for a in arrays)
    for job_id in ordered[: req.limit]:
        row = summarize(live[job_id]) if job_id in live else _summary_of_row(finished[job_id])
        size += len(row.model_dump_json().encode()) + 1
        if size > REPLY_BUDGET:
            break
        rows.append(row)
    return QueueResult(jobs=rows, total=len(ordered), arrays=arrays)


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


async def _read(ctx: Context, query: Callable[[StoreReader], _T]) -> _T:
    """Run a read of the database on a worker thread with its own connection: big reads (`queue --all`,
    `stats`) must not stall the event loop that serves every other client."""
    path = ctx.engine.store.path

    def run() -> _T:
        reader = StoreReader.open(path)
        try:
            return query(reader)
        finally:
            reader.close()

    return await asyncio.to_thread(run)


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
    if job.state not in (JobState.PENDING, *ACTIVE_STATES) or not isinstance(sched, Scheduler):
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
        with ctx.engine.store.batch():  # one COMMIT per chunk, not one per job (an array has 10,000)
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
        data = _read_log(path, req.offset, req.max_bytes)
        if data or finished or loop.time() >= deadline or ctx.engine.shutting_down:
            break
        # Log growth is not an engine event; a short poll inside the daemon keeps the client simple.
        await asyncio.sleep(min(0.1, max(0.0, deadline - loop.time())))
    if not finished:
        data = _complete_utf8(data)  # never split a character across two replies
    next_offset = req.offset + len(data)
    eof = finished and _log_size(path) <= next_offset
    return LogsResult(data=data.decode("utf-8", errors="replace"), next_offset=next_offset, eof=eof)


async def wait(ctx: Context, req: WaitRequest) -> WaitResult:
    _find(ctx, req.job_id)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + req.timeout_s
    while True:
        job = _current(ctx, req.job_id)
        remaining = deadline - loop.time()
        if job.state in TERMINAL_STATES or remaining <= 0 or ctx.engine.shutting_down:
            return WaitResult(job=_redact(ctx, job), finished=job.state in TERMINAL_STATES)
        await ctx.engine.wait_for_change(remaining)


def suspend(ctx: Context, req: SuspendRequest) -> JobsChanged:
    return _each(ctx, req.job_ids, "suspend", lambda job, why: ctx.engine.suspend(job, why), "suspended")


def resume(ctx: Context, req: ResumeRequest) -> JobsChanged:
    return _each(ctx, req.job_ids, "resume", lambda job, why: ctx.engine.resume(job, why), "resumed")


def hold(ctx: Context, req: HoldRequest) -> JobsChanged:
    return _each(ctx, req.job_ids, "hold", lambda job, why: ctx.engine.hold(job, why), "held")


def release(ctx: Context, req: ReleaseRequest) -> JobsChanged:
    return _each(ctx, req.job_ids, "release", lambda job, why: ctx.engine.release(job, why), "released")


def _each(ctx: Context, job_ids: list[int], verb: str, act: Callable[[Job, str], str | None],
          past: str) -> JobsChanged:
    """Apply `act` to every job after checking all of them exist and are the caller's (all or nothing).

    Ids are deduplicated and checked by owner before anything is loaded: finished jobs are never
    loaded at all (nothing can change them), so a request's cost does not depend on others' specs.
    """
    refs = [_ref(ctx, job_id) for job_id in _unique(job_ids)]
    for ref in refs:
        _require_owner(ctx, ref, verb)
    changed, unchanged = [], {}
    for ref in refs:
        by = "" if ref.uid == ctx.peer.uid else f" by {ctx.user}"
        why_not = act(ref.job, f"{past}{by}") if ref.job is not None else f"job is {ref.state}, it has ended"
        if why_not is None:
            changed.append(ref.id)
        else:
            unchanged[ref.id] = why_not
    return JobsChanged(changed=changed, unchanged=unchanged)


def gpu_drain(ctx: Context, req: GpuDrainRequest) -> DevicesChanged:
    _require_admin(ctx, "drain devices")
    reason = f"drained by {ctx.user}" + (f": {req.reason}" if req.reason else "")
    try:
        drained = ctx.engine.drain(req.device, reason)
    except DeviceError as exc:
        raise ProtocolError(ErrorCode.NOT_FOUND, str(exc)) from None
    message = f"{len(drained)} device(s) drained; running jobs continue, no new job starts there"
    return DevicesChanged(devices=drained, message=message if drained else "already drained")


def gpu_resume(ctx: Context, req: GpuResumeRequest) -> DevicesChanged:
    _require_admin(ctx, "resume devices")
    try:
        resumed = ctx.engine.resume_device(req.device, ctx.user)
    except DeviceError as exc:
        raise ProtocolError(ErrorCode.NOT_FOUND, str(exc)) from None
    return DevicesChanged(devices=resumed, message=f"{len(resumed)} device(s) back in service" if resumed
                          else "not drained")


async def mig_apply(ctx: Context, req: MigApplyRequest) -> MigApplyResult:
    _require_admin(ctx, "change MIG layouts")
    try:
        change, done = await ctx.engine.apply_mig_layout(req.gpu, req.layout, req.dry_run)
    except DeviceError as exc:
        raise ProtocolError(ErrorCode.INVALID_STATE, str(exc)) from None
    except GpuError as exc:
        raise ProtocolError(ErrorCode.INTERNAL, f"GPU {req.gpu}: {exc.message}", exc.hint) from None
    if change.error is not None:
        raise ProtocolError(ErrorCode.INVALID_STATE, change.error, "nothing was changed")
    return MigApplyResult(
        gpu=req.gpu, keep=list(change.keep), destroy=list(change.destroy),
        create=[PlannedInstance(profile=p, start=st) for p, st in change.create], applied=not req.dry_run, log=done,
    )


def sim_inject_xid(ctx: Context, req: SimInjectXidRequest) -> SimResult:
    _require_admin(ctx, "inject faults")
    sim = simulator_of(ctx.engine.backend)
    if sim is None:
        raise ProtocolError(ErrorCode.INVALID_STATE, "this daemon drives real GPUs; faults can only be "
                            "injected into simulated ones (gpuschedd --sim)")
    if not any(g.index == req.gpu for g in ctx.engine.inventory.gpus):
        raise ProtocolError(ErrorCode.NOT_FOUND, f"no GPU {req.gpu}")
    if req.lost:
        sim.lose_gpu(req.gpu)
        return SimResult(message=f"GPU {req.gpu} fell off the bus")
    sim.inject_xid(req.gpu, req.xid, req.gi, req.ci)
    scope = f" (GI {req.gi}" + (f", CI {req.ci}" if req.ci is not None else "") + ")" if req.gi is not None else ""
    return SimResult(message=f"XID {req.xid} injected on GPU {req.gpu}{scope}")


async def watch(ctx: Context, req: WatchRequest) -> AsyncIterator[TopSnapshot]:
    """Push a snapshot now and after every change (coalesced to `max_rate_hz`), for `gpusched top`."""
    engine = ctx.engine
    loop = asyncio.get_running_loop()
    seq = 0
    while not engine.shutting_down:
        seq += 1
        yield await _top_snapshot(ctx, seq, req.max_pending)
        sent = loop.time()
        await engine.wait_for_change(2.0)  # a heartbeat at least every 2 s keeps runtimes moving
        await asyncio.sleep(max(0.0, 1.0 / req.max_rate_hz - (loop.time() - sent)))


async def _top_snapshot(ctx: Context, seq: int, max_pending: int) -> TopSnapshot:
    engine = ctx.engine
    jobs = sorted(engine.jobs.values(), key=lambda j: j.id)
    active = [j for j in jobs if j.state in ACTIVE_STATES]
    pending = [j for j in jobs if j.state in (JobState.PENDING, JobState.HELD)]
    memory = await asyncio.to_thread(gpu_memory_by_job, engine.backend, active)
    standing = engine.scheduler.export_standing() if hasattr(engine.scheduler, "export_standing") else {}
    counts: dict[str, list[int]] = {}  # user -> [running, pending, next pending job id]
    for job in jobs:
        row = counts.setdefault(job.user, [0, 0, 0])
        if job.state in ACTIVE_STATES:
            row[0] += 1
        elif job.state is JobState.PENDING:
            row[1] += 1
            row[2] = row[2] or job.id
    users = [
        TopUser(user=user, weight=engine.weight_of(user), running=r, pending=p,
                service_gpu_h=standing.get(user, {}).get("service", 0.0) / 3600,
                lag_gpu_s=standing[user]["lag"] if user in standing else None, next_job=nxt or None)
        for user, (r, p, nxt) in sorted(counts.items()) if r or p
    ]
    return TopSnapshot(
        seq=seq, now=engine.clock(), gpus=gpus(ctx, GpusRequest()).gpus,
        running=[_top_job(j, memory.get(j.id)) for j in active],
        pending=[_top_job(j, None) for j in pending[:max_pending]], pending_total=len(pending),
        users=users, events=engine.store.events(limit=20),
    )


def _top_job(job: Job, gpu_mem_mib: int | None) -> TopJob:
    return TopJob(id=job.id, name=job.display_name, user=job.user, state=job.state,
                  request=describe_request(job.spec.request),
                  devices=job.allocation.uuids if job.allocation is not None else [],
                  submitted_at=job.submitted_at, started_at=job.started_at, gpu_mem_mib=gpu_mem_mib)


async def stats(ctx: Context, req: StatsRequest) -> StatsResult:
    engine = ctx.engine
    now = engine.clock()
    since = now - req.since_s

    def figures(reader: StoreReader) -> tuple[list[UserStats], dict[str, float]]:
        jobs = reader.jobs_touching(since, with_spec=False)  # accounting needs times and allocations only
        return user_stats(jobs, since, now, engine.weight_of), device_busy_fraction(jobs, since, now)

    users, busy = await _read(ctx, figures)
    devices = []
    for gpu in engine.inventory.gpus:
        if not gpu.mig_enabled:
            devices.append(DeviceStatsInfo(gpu=gpu.index, uuid=gpu.uuid, kind="gpu", profile=None,
                                           busy_fraction=min(1.0, busy.get(gpu.uuid, 0.0))))
        for inst in gpu.instances:
            devices.append(DeviceStatsInfo(gpu=gpu.index, uuid=inst.uuid, kind="mig", profile=inst.profile,
                                           busy_fraction=min(1.0, busy.get(inst.uuid, 0.0))))
    return StatsResult(
        since=since, now=now, jain_index=fairness_index(users), devices=devices,
        users=[UserStatsInfo(user=u.user, weight=u.weight, jobs=u.jobs, starts=u.starts, runtime_s=u.runtime_s,
                             service_gpu_h=u.service_gpu_s / 3600, share=u.share, entitled=u.entitled,
                             wait_avg_s=u.wait_avg_s, wait_max_s=u.wait_max_s, wait_max_at=u.wait_max_at)
               for u in users],
    )


async def reload(ctx: Context, req: ReloadRequest) -> ReloadResult:
    _require_admin(ctx, "reload the configuration")
    if ctx.reload is None:
        raise ProtocolError(ErrorCode.INVALID_STATE, "this daemon cannot reload its configuration")
    try:
        return await ctx.reload()
    except ConfigError as exc:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"configuration not reloaded: {exc}",
                            "fix the file and reload again; the daemon keeps running on its previous configuration"
                            ) from None


async def doctor(ctx: Context, req: DoctorRequest) -> DoctorResult:
    checks = await asyncio.to_thread(run_checks, ctx.engine, ctx.socket_path)
    if not ctx.admin:  # other users' pids and command lines are theirs
        checks = [c.model_copy(update={"detail": "CUDA processes not started by gpusched are present"})
                  if c.name == "processes" and c.status != "PASS" else c for c in checks]
    return DoctorResult(checks=checks)


def gpus(ctx: Context, req: GpusRequest) -> GpusResult:
    inventory = ctx.engine.inventory
    holders: dict[str, list[Job]] = {}
    for job in ctx.engine.active_jobs():
        if job.allocation is not None:
            for uuid in job.allocation.uuids:
                holders.setdefault(uuid, []).append(job)
    out = []
    devices = ctx.engine.devices
    for gpu in inventory.gpus:
        health = _health(gpu.uuid, devices.drain_reason(gpu.uuid), inventory.errors.get(gpu.index))
        instances = [
            InstanceInfo(
                uuid=i.uuid, profile=i.profile, start=i.start, size=i.size, memory_mib=i.memory_mib,
                sm_count=i.sm_count, health=_health(i.uuid, devices.drain_reason(i.uuid), None) if health == "ok"
                else health, jobs=[j.id for j in holders.get(i.uuid, [])],
                users=sorted({j.user for j in holders.get(i.uuid, [])}), gi_id=i.gi_id,
            )
            for i in sorted(gpu.instances, key=lambda i: i.start)
        ]
        gpu_config = ctx.engine.config.gpus.get(str(gpu.index))
        on_gpu = holders.get(gpu.uuid, [])
        out.append(GpuInfo(
            index=gpu.index, uuid=gpu.uuid, name=gpu.name, model=gpu.model, memory_total_mib=gpu.memory_total_mib,
            memory_used_mib=gpu.memory_used_mib, sm_count=gpu.sm_count, mig_enabled=gpu.mig_enabled,
            mig_pending=gpu.mig_pending, health=health, instances=instances, jobs=[j.id for j in on_gpu],
            users=sorted({j.user for j in on_gpu}),
            share=gpu_config.share if gpu_config is not None else "exclusive",
            interactive=gpu_config.interactive if gpu_config is not None else False,
        ))
    return GpusResult(backend=ctx.backend_name, driver_version=inventory.driver_version, gpus=out)


def shutdown(ctx: Context, req: ShutdownRequest) -> ShutdownResult:
    if not ctx.admin:
        raise ProtocolError(ErrorCode.PERMISSION_DENIED, "only an administrator may shut the daemon down",
                            "use `sudo systemctl stop gpusched`")
    ctx.request_shutdown()
    return ShutdownResult(stopping=True)


Handler = Callable[[Context, Any], Any | Awaitable[Any]]
HANDLERS: dict[str, Handler] = {
    "hello": hello, "submit": submit, "queue": queue, "show": show, "cancel": cancel,
    "logs": logs, "wait": wait, "suspend": suspend, "resume": resume, "hold": hold, "release": release,
    "gpu_drain": gpu_drain, "gpu_resume": gpu_resume, "mig_apply": mig_apply, "sim_inject_xid": sim_inject_xid,
    "doctor": doctor, "reload": reload, "stats": stats, "watch": watch, "gpus": gpus, "shutdown": shutdown,
}


# ---- helpers -------------------------------------------------------------------------------------


def summarize(job: Job) -> JobSummary:
    return JobSummary(
        id=job.id, name=job.display_name, user=job.user, uid=job.uid, state=job.state,
        request=describe_request(job.spec.request), submitted_at=job.submitted_at, started_at=job.started_at,
        ended_at=job.ended_at, exit_code=job.exit_code,
        devices=job.allocation.uuids if job.allocation is not None else [], reason=bounded(job.reason, MAX_REASON),
        array_id=job.array_id, array_task=job.array_task,
    )


def _summary_of_row(row: SummaryRow) -> JobSummary:
    return JobSummary(
        id=row.id, name=row.display, user=row.user, uid=row.uid, state=row.state, request=row.request,
        submitted_at=row.submitted_at, started_at=row.started_at, ended_at=row.ended_at, exit_code=row.exit_code,
        devices=row.devices, reason=bounded(row.reason, MAX_REASON), array_id=row.array_id, array_task=row.array_task,
    )


@dataclass(frozen=True, slots=True)
class _JobRef:
    """Who owns a job and its state; `job` is the live job when it has not finished."""

    id: int
    uid: int
    user: str
    state: JobState
    job: Job | None


def _ref(ctx: Context, job_id: int) -> _JobRef:
    job = ctx.engine.jobs.get(job_id)  # every unfinished job is in memory
    if job is not None:
        return _JobRef(job.id, job.uid, job.user, job.state, job)
    row = ctx.engine.store.owner(job_id)
    if row is None:
        raise _no_job(ctx, job_id)
    return _JobRef(job_id, row[0], row[1], row[2], None)


def _no_job(ctx: Context, job_id: int) -> ProtocolError:
    """NOT_FOUND for an id that names no job: an array's id says how to name its tasks."""
    array = ctx.engine.store.arrays([job_id]).get(job_id)
    if array is not None:
        return ProtocolError(ErrorCode.NOT_FOUND, f"{job_id} is a job array ({array.task_count} tasks), not a job",
                             f"name one task as {job_id}_TASK (e.g. {job_id}_{array.tasks.split(',')[0].split('-')[0]}"
                             f"); `show {job_id}` and `cancel {job_id}` take the whole array")
    return ProtocolError(ErrorCode.NOT_FOUND, f"no job {job_id}", "`gpusched queue --all` lists known jobs")


def _task_job(ctx: Context, array_id: int, task: int) -> int:
    """The job id of task `task` of array `array_id` (`123_7`)."""
    job_id = ctx.engine.store.task_job_id(array_id, task)
    if job_id is None:
        if ctx.engine.store.arrays([array_id]).get(array_id) is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no job array {array_id}",
                                "`gpusched queue --all` lists known jobs and arrays")
        raise ProtocolError(ErrorCode.NOT_FOUND, f"job array {array_id} has no task {task}",
                            f"`gpusched show {array_id}` shows its tasks")
    return job_id


def _unique(job_ids: list[int]) -> list[int]:
    """The ids once each, in the order given."""
    return list(dict.fromkeys(job_ids))


def _health(uuid: str, drained: str | None, error: str | None) -> str:
    if error is not None:
        return f"error: {error}"
    return f"drained: {drained}" if drained is not None else "ok"


def _require_admin(ctx: Context, what: str) -> None:
    if not ctx.admin:
        raise ProtocolError(ErrorCode.PERMISSION_DENIED, f"only an administrator may {what}",
                            "run it as root or as a member of the configured admin_group")


def _find(ctx: Context, job_id: int) -> Job:
    job = ctx.engine.get(job_id)
    if job is None:
        raise _no_job(ctx, job_id)
    return job


def _current(ctx: Context, job_id: int) -> Job:
    job = ctx.engine.get(job_id)
    if job is None:  # finished jobs are pruned after finished_job_retention_s / beyond max_finished_jobs
        raise ProtocolError(ErrorCode.NOT_FOUND, f"job {job_id} has ended and its record was pruned",
                            "finished jobs are kept for finished_job_retention_s (see docs/config.md)")
    return job


def _may_act(ctx: Context, job: Job | _JobRef) -> bool:
    return ctx.admin or job.uid == ctx.peer.uid


def _require_owner(ctx: Context, job: Job | _JobRef, verb: str) -> None:
    if not _may_act(ctx, job):
        raise ProtocolError(
            ErrorCode.PERMISSION_DENIED,
            f"job {job.id} belongs to {job.user}; {ctx.user} may not {verb} it",
            "only the job's owner or an administrator may do this",
        )


def _redact(ctx: Context, job: Job) -> Job:
    """Anyone may see that a job exists and where it runs, but not its owner's environment."""
    if _may_act(ctx, job):
        return job
    return job.model_copy(update={"spec": job.spec.model_copy(update={"env": {}})})


def _read_log(path: str, offset: int, limit: int) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(limit)
    except (OSError, OverflowError):  # missing, or an offset past what the filesystem can address
        return b""


def _log_size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


def _complete_utf8(data: bytes) -> bytes:
    """`data` without a trailing partial UTF-8 sequence (the rest arrives with the next read)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # a lead byte or ASCII: is its sequence complete?
            need = 1 if byte < 0x80 else 2 if byte >> 5 == 0x6 else 3 if byte >> 4 == 0xE else 4
            return data if need <= back else data[:-back]
    return data
