"""What every request handler shares: the request's context (who asks, as the kernel says), reads off
the loop, and the checks and shapes that answers have in common (ownership, redaction, summaries)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from gpusched.daemon.engine import Engine
from gpusched.daemon.store import StoreReader, SummaryRow
from gpusched.model import (
    Job,
    JobState,
    bounded,
    describe_request,
)
from gpusched.protocol import (
    MAX_FRAME,
    ErrorCode,
    JobSummary,
    ProtocolError,
    ReloadResult,
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


async def _read(ctx: Context, query: Callable[[StoreReader], _T]) -> _T:
    """Run a read of the database on a worker thread with its own connection: big reads (`queue --all`,
    `stats`) must not stall the event loop that serves every other client (nor may one user's many)."""
    path = ctx.engine.store.path

    def run() -> _T:
        reader = StoreReader.open(path)
        try:
            return query(reader)
        finally:
            reader.close()

    async with ctx.engine.reads.slot(ctx.peer.uid):
        return await asyncio.to_thread(run)


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
                             f"); `show`, `cancel`, `hold`, `release`, `suspend`, `resume` and `submit --after` "
                             f"take {job_id} for the whole array")
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
    """Up to `limit` bytes of a job's log from `offset`. The log belongs to the job's user, who may
    take a lease on it: a plain open() would then wait for the kernel's lease-break time (45 s) with
    the event loop, and every client, waiting too. O_NONBLOCK makes such an open fail at once."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except BlockingIOError:
        raise ProtocolError(ErrorCode.INVALID_STATE, "the job's log is held under a lease by one of its processes",
                            "try again once the job lets go of it") from None
    except OSError:  # missing
        return b""
    try:
        return os.pread(fd, limit, offset)
    except (OSError, OverflowError):  # an offset past what the filesystem can address
        return b""
    finally:
        os.close(fd)


def _log_size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


def _complete_utf8(data: bytes) -> bytes:
    """`data` without a trailing partial UTF-8 sequence (the rest arrives with the next read). A
    byte that can never start one (0xF8-0xFF, or a stray continuation) is not held back: no later
    byte completes it, and it goes out as U+FFFD."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # a lead byte or ASCII: is its sequence complete?
            if byte >= 0xF8:
                return data
            need = 1 if byte < 0x80 else 2 if byte >> 5 == 0x6 else 3 if byte >> 4 == 0xE else 4
            return data if need <= back else data[:-back]
    return data
