"""Wire format shared by daemon and client: framed JSON and one pydantic model per request (the
results' models are in protocol_results.py, re-exported here).

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON (one object).
Frames over `MAX_FRAME` are refused before they are read, so a client cannot make the daemon buffer
more than that. The first exchange on a connection is `hello`; a different major version is refused
with a message naming both versions. See docs/protocol.md (kept in step by a test).

The framing itself is in `gpusched.wire` (standard library only, for the client's start-up); the
daemon validates every request with the models here, the client sends plain JSON of the same shape.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator

from gpusched.arrayspec import MAX_SPEC_CHARS, MAX_TASK_INDEX, ArraySpecError, parse_array_spec
from gpusched.model import JobId, JobSpec, bounded

# The results (protocol_results.py) and the plain part (framing, codes, version, sockets, in
# gpusched.wire so the client can use it without pydantic) are re-exported here, so
# `gpusched.protocol` stays the daemon's one import.
from gpusched.protocol_results import RESULT_TYPES as RESULT_TYPES
from gpusched.protocol_results import ArraySummary as ArraySummary
from gpusched.protocol_results import CancelResult as CancelResult
from gpusched.protocol_results import DevicesChanged as DevicesChanged
from gpusched.protocol_results import DeviceStatsInfo as DeviceStatsInfo
from gpusched.protocol_results import DoctorCheck as DoctorCheck
from gpusched.protocol_results import DoctorResult as DoctorResult
from gpusched.protocol_results import ErrorBody as ErrorBody
from gpusched.protocol_results import ErrorResponse as ErrorResponse
from gpusched.protocol_results import GpuInfo as GpuInfo
from gpusched.protocol_results import GpusResult as GpusResult
from gpusched.protocol_results import HelloResult as HelloResult
from gpusched.protocol_results import InstanceInfo as InstanceInfo
from gpusched.protocol_results import JobsChanged as JobsChanged
from gpusched.protocol_results import JobSummary as JobSummary
from gpusched.protocol_results import LogsResult as LogsResult
from gpusched.protocol_results import MigApplyResult as MigApplyResult
from gpusched.protocol_results import PartitionInfo as PartitionInfo
from gpusched.protocol_results import PlannedInstance as PlannedInstance
from gpusched.protocol_results import QueueResult as QueueResult
from gpusched.protocol_results import ReloadResult as ReloadResult
from gpusched.protocol_results import RuntimeEstimate as RuntimeEstimate
from gpusched.protocol_results import ShowResult as ShowResult
from gpusched.protocol_results import ShutdownResult as ShutdownResult
from gpusched.protocol_results import SimResult as SimResult
from gpusched.protocol_results import StatsResult as StatsResult
from gpusched.protocol_results import SubmitResult as SubmitResult
from gpusched.protocol_results import TopJob as TopJob
from gpusched.protocol_results import TopSnapshot as TopSnapshot
from gpusched.protocol_results import TopUser as TopUser
from gpusched.protocol_results import UserStatsInfo as UserStatsInfo
from gpusched.protocol_results import WaitResult as WaitResult
from gpusched.protocol_results import error as error
from gpusched.protocol_results import ok as ok
from gpusched.protocol_results import ok_body as ok_body
from gpusched.protocol_results import unset as _unset
from gpusched.submittable import check_submittable
from gpusched.wire import HEADER as HEADER
from gpusched.wire import MAX_FRAME as MAX_FRAME
from gpusched.wire import MIN_SHARE as MIN_SHARE
from gpusched.wire import PROTOCOL_VERSION as PROTOCOL_VERSION
from gpusched.wire import ROOT_SOCKET as ROOT_SOCKET
from gpusched.wire import ErrorCode as ErrorCode
from gpusched.wire import ProtocolError as ProtocolError
from gpusched.wire import check_version as check_version
from gpusched.wire import decode_body as decode_body
from gpusched.wire import encode_frame as encode_frame
from gpusched.wire import frame as frame
from gpusched.wire import frame_length as frame_length
from gpusched.wire import socket_candidates as socket_candidates
from gpusched.wire import user_socket as user_socket

TaskIndex = Annotated[int, Field(ge=0, le=MAX_TASK_INDEX)]


class _Req(BaseModel):
    model_config = ConfigDict(extra="forbid")


class HelloRequest(_Req):
    op: Literal["hello"] = "hello"
    version: str = Field(description="the client's PROTOCOL_VERSION, MAJOR.MINOR")
    client: str = Field(default="", max_length=64)


class SubmitRequest(_Req):
    op: Literal["submit"] = "submit"
    spec: JobSpec
    hold: bool = Field(default=False, description="submit in HELD state (start only after release)")
    array: str | None = Field(
        default=None, max_length=MAX_SPEC_CHARS, exclude_if=_unset,
        description="a job array as sbatch's --array: A-B[:STEP] or a comma list of those, optionally %MAX "
        "(at most MAX tasks run at once); one task per index, each with GPUSCHED_ARRAY_TASK_ID set",
    )
    request_id: str | None = Field(
        default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$", exclude_if=_unset,
        description="client-chosen idempotency key (e.g. a random UUID): a submit that repeats a request_id "
        "of the same user returns the job (or array) the first one created, with duplicate = true, and creates "
        "nothing; so a client whose connection broke before the answer may safely send the submit again",
    )

    @field_validator("spec")
    @classmethod
    def _submittable(cls, spec: JobSpec) -> JobSpec:
        check_submittable(spec)  # (on submit only: stored jobs still load)
        return spec

    @field_validator("array")
    @classmethod
    def _array_spec(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                parse_array_spec(value)
            except ArraySpecError as exc:
                raise ValueError(str(exc)) from None
        return value


class QueueRequest(_Req):
    op: Literal["queue"] = "queue"
    all: bool = Field(default=False, description="include finished jobs")
    user: str | None = Field(default=None, description="only this user's jobs")
    array_tasks: bool = Field(default=False, exclude_if=_unset,
                              description="list each task of a job array as its own row (default: one row per array "
                              "in `arrays`, its tasks left out of `jobs`)")
    limit: int = Field(default=1000, ge=1, le=3000, description="at most this many rows (a reply must fit in "
                       "one frame); with --all the newest finished jobs fill what pending and active jobs leave")
    after_id: int | None = Field(
        default=None, ge=0, le=2**63 - 1,
        description="page through jobs in id order: only ids above this (0 for the first page); with --all, "
        "finished jobs too",
    )
    order: Literal["id", "fairness"] = Field(
        default="id", description="id: submission order; fairness: active jobs, then pending in the order "
        "the scheduler would start them"
    )


class ShowRequest(_Req):
    op: Literal["show"] = "show"
    job_id: JobId = Field(description="a job, or an array (its tasks are listed)")
    task: TaskIndex | None = Field(default=None, exclude_if=_unset,
                                   description="task index: job_id names the array (`show 123_7`)")


class TaskRef(_Req):
    """One task of a job array: `123_7` is array 123, task 7."""

    array_id: JobId
    task: TaskIndex


class CancelRequest(_Req):
    op: Literal["cancel"] = "cancel"
    job_ids: list[JobId] = Field(default_factory=list, max_length=10_000,
                                 description="jobs; an array's id cancels every task of the array")
    tasks: list[TaskRef] = Field(default_factory=list, max_length=10_000, exclude_if=_unset,
                                 description="single array tasks")

    @model_validator(mode="after")
    def _something(self) -> CancelRequest:
        if not self.job_ids and not self.tasks:
            raise ValueError("name at least one job (job_ids) or array task (tasks)")
        return self


class LogsRequest(_Req):
    op: Literal["logs"] = "logs"
    job_id: JobId
    task: TaskIndex | None = Field(default=None, exclude_if=_unset,
                                   description="task index: job_id names the array (`logs 123_7`)")
    offset: int = Field(default=0, ge=0, le=2**62, description="byte offset to read from")
    max_bytes: int = Field(default=256 * 1024, ge=1, le=512 * 1024)
    wait_s: float = Field(default=0.0, ge=0.0, le=30.0, description="long-poll for new output")


class WaitRequest(_Req):
    op: Literal["wait"] = "wait"
    job_id: JobId
    task: TaskIndex | None = Field(default=None, exclude_if=_unset,
                                   description="task index: job_id names the array (`wait 123_7`)")
    timeout_s: float = Field(default=30.0, ge=0.0, le=300.0)


class _JobControl(_Req):
    """suspend / resume / hold / release: jobs (an array's id: every unfinished task) and single tasks."""

    op: str  # each request's Literal; declared here so that it stays the first member of the frame
    job_ids: list[JobId] = Field(default_factory=list, max_length=10_000,
                                 description="jobs; an array's id names every unfinished task of the array")
    tasks: list[TaskRef] = Field(default_factory=list, max_length=10_000, exclude_if=_unset,
                                 description="single array tasks (`123_7`)")

    @model_validator(mode="after")
    def _something(self) -> Self:
        if not self.job_ids and not self.tasks:
            raise ValueError("name at least one job (job_ids) or array task (tasks)")
        return self


class SuspendRequest(_JobControl):
    """SIGSTOP the whole job; it keeps its devices and GPU memory."""

    op: Literal["suspend"] = "suspend"


class ResumeRequest(_JobControl):
    """SIGCONT a suspended job."""

    op: Literal["resume"] = "resume"


class HoldRequest(_JobControl):
    """Keep pending jobs from starting until released."""

    op: Literal["hold"] = "hold"


class ReleaseRequest(_JobControl):
    op: Literal["release"] = "release"


class GpuDrainRequest(_Req):
    """Admin: take a GPU (by index or UUID) or MIG instance out of service; running jobs continue."""

    op: Literal["gpu_drain"] = "gpu_drain"
    device: str = Field(min_length=1, max_length=128)
    reason: str = Field(default="", max_length=256)


class GpuResumeRequest(_Req):
    """Admin: put a drained GPU or MIG instance back in service."""

    op: Literal["gpu_resume"] = "gpu_resume"
    device: str = Field(min_length=1, max_length=128)


class MigApplyRequest(_Req):
    """Admin: make a GPU hold exactly `layout` (profile names), changing only what differs."""

    op: Literal["mig_apply"] = "mig_apply"
    gpu: int = Field(ge=0)
    layout: list[str] = Field(max_length=8)
    dry_run: bool = False


class SimInjectXidRequest(_Req):
    """Admin, simulated GPUs only: deliver an XID (or a lost GPU) as the driver would."""

    op: Literal["sim_inject_xid"] = "sim_inject_xid"
    gpu: int = Field(ge=0)
    xid: int = Field(ge=1, le=1000)
    gi: int | None = Field(default=None, ge=0)
    ci: int | None = Field(default=None, ge=0)
    lost: bool = Field(default=False, description="the GPU falls off the bus instead")


class WatchRequest(_Req):
    """Stream TopSnapshot frames: one now, then one whenever something changes (at most
    `max_rate_hz` a second), and at least every max(2 s, 1 / max_rate_hz) so runtimes tick, until
    the client hangs up."""

    op: Literal["watch"] = "watch"
    max_rate_hz: float = Field(default=4.0, ge=0.1, le=20.0)
    max_pending: int = Field(default=50, ge=0, le=1000, description="pending jobs listed (all are counted)")


class StatsRequest(_Req):
    """Per-user service, share and waits, Jain's index and device use over the last `since_s` seconds."""

    op: Literal["stats"] = "stats"
    since_s: float = Field(default=3600.0, gt=0, le=366 * 86400)


class ReloadRequest(_Req):
    """Admin: re-read the config file (like SIGHUP); a bad file is refused and the old config kept."""

    op: Literal["reload"] = "reload"


class DoctorRequest(_Req):
    """Run the daemon's health checks (driver, MIG, foreign processes, cgroups, permissions)."""

    op: Literal["doctor"] = "doctor"


class GpusRequest(_Req):
    op: Literal["gpus"] = "gpus"


class ShutdownRequest(_Req):
    op: Literal["shutdown"] = "shutdown"


Request = Annotated[
    HelloRequest
    | SubmitRequest
    | QueueRequest
    | ShowRequest
    | CancelRequest
    | LogsRequest
    | WaitRequest
    | SuspendRequest
    | ResumeRequest
    | HoldRequest
    | ReleaseRequest
    | GpuDrainRequest
    | GpuResumeRequest
    | MigApplyRequest
    | SimInjectXidRequest
    | DoctorRequest
    | ReloadRequest
    | StatsRequest
    | WatchRequest
    | GpusRequest
    | ShutdownRequest,
    Field(discriminator="op"),
]
@functools.cache
def request_adapter() -> TypeAdapter[Request]:
    """The discriminated union of every request; built on first use (the CLI never parses requests)."""
    return TypeAdapter(Request)


def __getattr__(name: str) -> Any:
    if name == "REQUEST_ADAPTER":  # kept as an attribute for tests and tools
        return request_adapter()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def parse_frame(body: bytes) -> Request:
    """`parse_request(decode_body(body))`, in one step for a valid request: pydantic reads the JSON
    itself (3 us less per request than json.loads and then validating the objects it made). A
    body it refuses goes the long way round, so that every error reads as it always has."""
    try:
        return request_adapter().validate_json(body)
    except ValidationError:
        return parse_request(decode_body(body))


def parse_request(obj: dict[str, Any]) -> Request:
    """Validate a request object; the error names the first bad field and what is wrong with it."""
    try:
        return request_adapter().validate_python(obj)
    except ValidationError as exc:
        raise ProtocolError(ErrorCode.BAD_REQUEST, describe_validation_error(exc)) from None


def describe_validation_error(exc: ValidationError) -> str:
    """`field.path: problem` for each error (at most 3), e.g. `spec.request.gpus: must be >= 1`."""
    parts = []
    for err in exc.errors()[:3]:
        loc = ".".join(str(p) for p in _strip_tags(err["loc"]))
        if not loc:
            loc = "op" if err["type"].startswith("union_tag") else "(message)"
        # both can carry what the client sent (an unknown field's name, a bad tag's value): bounded,
        # so that a bad request's answer is always a bad_request, never a reply too large to send
        parts.append(f"{bounded(loc, 200)}: {bounded(str(err['msg']), 300)}")
    more = len(exc.errors()) - 3
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


_UNION_TAGS = {"request": {"whole", "mig", "share"}}


def _strip_tags(loc: tuple[int | str, ...]) -> list[int | str]:
    """Drop the discriminator values pydantic puts in error paths (`submit.spec.request.whole.gpus`)."""
    out: list[int | str] = []
    for i, part in enumerate(loc):
        if i == 0 and isinstance(part, str) and part in RESULT_TYPES:
            continue
        if out and isinstance(out[-1], str) and part in _UNION_TAGS.get(out[-1], ()):
            continue
        out.append(part)
    return out


def json_schema() -> dict[str, Any]:
    """The JSON Schema of every request and result; docs/protocol.md embeds it."""
    requests = request_adapter().json_schema(ref_template="#/$defs/{model}")
    results = {name: model.model_json_schema(ref_template="#/$defs/{model}") for name, model in RESULT_TYPES.items()}
    defs: dict[str, Any] = dict(requests.pop("$defs", {}))
    for schema in results.values():
        defs.update(schema.pop("$defs", {}))
    error_schema = ErrorResponse.model_json_schema(ref_template="#/$defs/{model}")
    defs.update(error_schema.pop("$defs", {}))
    defs["ErrorResponse"] = error_schema
    return {"request": requests, "results": results, "$defs": dict(sorted(defs.items()))}
