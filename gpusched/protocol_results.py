"""The result of every request, as the daemon sends it: one pydantic model per result, the error
response, and `RESULT_TYPES` (request op -> result model). protocol.py has the requests and the
framing, and re-exports all of this."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gpusched.model import Event, Job, JobState
from gpusched.wire import ErrorCode


def unset(value: object) -> bool:
    """`exclude_if` of the fields added in protocol 1.1: they are left out of a message while they
    hold their default, so a 1.0 peer (whose models refuse unknown members) still understands
    everything that does not use them."""
    return value is None or value is False or value == []


class _Res(BaseModel):
    model_config = ConfigDict(extra="forbid")


class HelloResult(_Res):
    version: str
    daemon_version: str
    uid: int
    user: str
    admin: bool
    backend: str


class SubmitResult(_Res):
    job_id: int = Field(description="the job's id; for an array, the array's id (its tasks are ARRAY_TASK)")
    state: JobState
    tasks: int | None = Field(default=None, exclude_if=unset, description="an array: how many tasks it has")
    duplicate: bool = Field(default=False, exclude_if=unset,
                            description="request_id was seen before: this is the job (or array) that request created, "
                            "and nothing new was created")


class JobSummary(_Res):
    """One row of `queue`; a stable shape for `--json`."""

    id: int
    name: str
    user: str
    uid: int
    state: JobState
    request: str
    submitted_at: float
    started_at: float | None
    ended_at: float | None
    exit_code: int | None
    devices: list[str]
    reason: str
    array_id: int | None = Field(default=None, exclude_if=unset, description="the job array this job is a task of")
    array_task: int | None = Field(default=None, exclude_if=unset, description="its task index in that array")


class ArraySummary(_Res):
    """One job array: what it runs and how many of its tasks are in each state."""

    id: int
    name: str
    user: str
    uid: int
    request: str
    submitted_at: float
    spec: str = Field(description="the --array spec as given, e.g. 1-10000%8")
    tasks: int = Field(description="how many tasks the array has")
    max_running: int | None = Field(default=None, description="%MAX: at most this many tasks run at once")
    states: dict[str, int] = Field(description="state -> number of its tasks in that state (finished ones "
                                   "included, as long as they are kept)")
    pending: str = Field(default="", description="the pending (and held) task indices, compressed: 5-10000")


class QueueResult(_Res):
    jobs: list[JobSummary]
    total: int = Field(default=0, description="rows that matched; more than len(jobs) when limited")
    arrays: list[ArraySummary] = Field(default_factory=list, exclude_if=unset,
                                       description="job arrays, one row each (their tasks are not in `jobs` unless "
                                       "array_tasks was asked for)")
    arrays_total: int | None = Field(default=None, exclude_if=unset,
                                     description="array rows that matched, present only when the limit (which "
                                     "array rows count against, after the jobs) left some out of `arrays`")


class RuntimeEstimate(_Res):
    """The scheduler's run-time estimate for a job (docs/scheduling.md, "Run-time estimates")."""

    runtime_s: float = Field(description="expected run time in seconds (capped by --time)")
    source: str = Field(description="what the estimate comes from, in words")
    expected_start_at: float | None = Field(
        default=None, description="pending: when it is expected to start (Unix time) if nothing new arrives; "
                                  "null when it cannot be told")
    expected_end_at: float | None = Field(
        default=None, description="running: when it is expected to end (Unix time), never before twice its "
                                  "elapsed time")


class ShowResult(_Res):
    job: Job = Field(description="the job; for an array, its first unfinished task (else its last one)")
    array: ArraySummary | None = Field(default=None, exclude_if=unset, description="the array `job` is a task of")
    waiting_reason: str | None = None
    log_path: str | None = None
    events: list[Event] = Field(default_factory=list, description="device events attributed to this job")
    estimate: RuntimeEstimate | None = Field(default=None, description="pending or running jobs under the fair-share "
                                                                       "scheduler")


class CancelResult(_Res):
    cancelled: list[int]
    already_finished: list[int] = Field(default_factory=list)
    arrays: list[int] = Field(default_factory=list, exclude_if=unset,
                              description="arrays named by id: their unfinished tasks are in `cancelled` (or "
                              "`already_finished`)")


class JobsChanged(_Res):
    """Result of suspend / resume / hold / release: which jobs changed and which were left as they were."""

    changed: list[int]
    unchanged: dict[int, str] = Field(default_factory=dict, description="job id -> why it was not changed")
    arrays: list[int] = Field(default_factory=list, exclude_if=unset,
                              description="arrays named by id: their tasks that changed are in `changed`; those "
                              "in another state are left as they are, unlisted")


class LogsResult(_Res):
    data: str
    next_offset: int
    eof: bool = Field(description="the job has finished and everything was read")


class WaitResult(_Res):
    job: Job
    finished: bool


class InstanceInfo(_Res):
    uuid: str
    profile: str
    start: int
    size: int
    memory_mib: int
    sm_count: int
    health: str
    jobs: list[int]
    users: list[str]
    gi_id: int | None = Field(default=None, description="the GPU instance id (for `sim inject-xid --gi`)")


class PartitionInfo(_Res):
    """Where an AMD Instinct logical GPU sits: its physical GPU and that GPU's partition modes."""

    physical_index: int = Field(description="the physical GPU (amdsmi socket), in enumeration order")
    physical_uuid: str
    compute_mode: str = Field(description="SPX, DPX, QPX or CPX: how many logical GPUs the physical GPU forms")
    memory_mode: str = Field(description="NPS1 or NPS4: how many NUMA memory partitions its HBM forms")
    index_in_physical: int = Field(description="this logical GPU's partition id, 0 .. count-1")
    count: int = Field(description="logical GPUs of the physical GPU in this compute mode")


class GpuInfo(_Res):
    index: int
    uuid: str
    name: str
    model: str
    memory_total_mib: int
    memory_used_mib: int | None
    sm_count: int
    mig_enabled: bool
    mig_pending: bool
    health: str
    instances: list[InstanceInfo]
    jobs: list[int]
    users: list[str]
    share: str = Field(default="exclusive", description="exclusive | mps | timeslice, from the daemon's config")
    interactive: bool = Field(default=False, description="reserved for --class interactive jobs")
    vendor: str = Field(default="nvidia", description="nvidia or amd")
    partition: PartitionInfo | None = Field(
        default=None, description="AMD Instinct: the logical GPU's physical GPU and partition modes; null on NVIDIA"
    )


class GpusResult(_Res):
    backend: str
    driver_version: str
    gpus: list[GpuInfo]


class DevicesChanged(_Res):
    """Result of gpu_drain / gpu_resume: the device UUIDs whose state changed."""

    devices: list[str]
    message: str


class PlannedInstance(_Res):
    profile: str
    start: int


class MigApplyResult(_Res):
    gpu: int
    keep: list[str]
    destroy: list[str]
    create: list[PlannedInstance]
    applied: bool
    log: list[str] = Field(default_factory=list)


class SimResult(_Res):
    message: str


class UserStatsInfo(_Res):
    """One user's figures over the window (the shape of `perf sched latency`, for GPU jobs)."""

    user: str
    weight: float
    jobs: int
    starts: int
    runtime_s: float
    service_gpu_h: float
    share: float = Field(description="fraction of all service delivered in the window")
    entitled: float = Field(description="weight / sum of weights of users with work in the window")
    wait_avg_s: float
    wait_max_s: float
    wait_max_at: float | None


class DeviceStatsInfo(_Res):
    gpu: int
    uuid: str
    kind: Literal["gpu", "mig"]
    profile: str | None
    busy_fraction: float = Field(description="fraction of the window the device was allocated")


class StatsResult(_Res):
    since: float
    now: float
    users: list[UserStatsInfo]
    jain_index: float = Field(description="Jain's index over service / entitled share; 1.0 is perfectly fair")
    devices: list[DeviceStatsInfo]


class TopJob(_Res):
    id: int
    name: str
    user: str
    state: JobState
    request: str
    devices: list[str]
    submitted_at: float
    started_at: float | None
    gpu_mem_mib: int | None = Field(default=None, description="GPU memory its processes use, when NVML says")


class TopUser(_Res):
    user: str
    weight: float
    running: int
    pending: int
    service_gpu_h: float = Field(description="service charged so far (the scheduler's standing)")
    lag_gpu_s: float | None = Field(description="positive: owed service; negative: ahead of its share")
    next_job: int | None


class TopSnapshot(_Res):
    seq: int
    now: float
    gpus: list[GpuInfo]
    running: list[TopJob]
    pending: list[TopJob] = Field(description="the first max_pending pending jobs in submission order")
    pending_total: int
    users: list[TopUser]
    events: list[Event]


class ReloadResult(_Res):
    changed: list[str] = Field(description="settings now in effect with their new values")
    restart_needed: list[str] = Field(description="changed settings that take effect only after a restart")
    not_applied: list[str] = Field(default_factory=list, exclude_if=unset,
                                   description="what of the new settings the node could not carry out yet, one "
                                   "line each (`gpus.N.mig: why`: a MIG layout a busy GPU or instance keeps "
                                   "back, applied once it is free)")


class DoctorCheck(_Res):
    name: str
    status: Literal["PASS", "WARN", "FAIL"]
    detail: str
    hint: str = ""


class DoctorResult(_Res):
    checks: list[DoctorCheck]


class ShutdownResult(_Res):
    stopping: bool


class ErrorBody(_Res):
    code: ErrorCode
    message: str
    hint: str = ""


class ErrorResponse(_Res):
    ok: Literal[False] = False
    error: ErrorBody


RESULT_TYPES: dict[str, type[BaseModel]] = {
    "hello": HelloResult,
    "submit": SubmitResult,
    "queue": QueueResult,
    "show": ShowResult,
    "cancel": CancelResult,
    "logs": LogsResult,
    "wait": WaitResult,
    "suspend": JobsChanged,
    "resume": JobsChanged,
    "hold": JobsChanged,
    "release": JobsChanged,
    "gpu_drain": DevicesChanged,
    "gpu_resume": DevicesChanged,
    "mig_apply": MigApplyResult,
    "sim_inject_xid": SimResult,
    "doctor": DoctorResult,
    "reload": ReloadResult,
    "stats": StatsResult,
    "watch": TopSnapshot,
    "gpus": GpusResult,
    "shutdown": ShutdownResult,
}


def ok(result: BaseModel) -> dict[str, Any]:
    return {"ok": True, "result": result.model_dump(mode="json")}


def ok_body(result: BaseModel) -> bytes | None:
    """The JSON of `ok(result)` in one step for a SubmitResult, answered thousands of times a second;
    None for the others (they go through `ok` and json.dumps)."""
    if type(result) is not SubmitResult:
        return None
    # Written by hand, the bytes json.dumps would write: pydantic's serialiser (before) calls `unset`
    # back for the two optional fields, 4k instructions more an answer. The state is an upper-case
    # word: nothing to escape.
    values = result.__dict__
    body = b'{"ok":true,"result":{"job_id":%d,"state":"%b"' % (values["job_id"], values["state"].encode())
    if values["tasks"] is not None:  # (`unset`: None, False and [] are left out; tasks is an int or None)
        body += b',"tasks":%d' % values["tasks"]
    if values["duplicate"]:
        body += b',"duplicate":true'
    return body + b"}}"


def error(code: ErrorCode, message: str, hint: str = "") -> dict[str, Any]:
    return ErrorResponse(error=ErrorBody(code=code, message=message, hint=hint)).model_dump(mode="json")


