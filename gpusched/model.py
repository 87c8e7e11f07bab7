"""Shared domain types: what a job asks for, what it gets, and where it is in its life.

These models cross every boundary (wire, SQLite, core), so they are plain pydantic data with no
behaviour that needs I/O. The client imports this module too, so it must stay dependency-light.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gpusched.modelattrs import remove_hook
from gpusched.wire import MAX_MEM_MIB

remove_hook()  # every model's attribute reads at CPython's fast path (modelattrs.py)


class JobState(StrEnum):
    """Life of a job; see ARCHITECTURE.md §5 for the legal transitions."""

    PENDING = "PENDING"
    HELD = "HELD"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    SUSPENDED = "SUSPENDED"
    PREEMPTED = "PREEMPTED"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    LOST = "LOST"


TERMINAL_STATES: frozenset[JobState] = frozenset(
    {JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED, JobState.TIMEOUT, JobState.LOST}
)
# States in which a job holds an allocation (devices are not free for others).
ACTIVE_STATES: frozenset[JobState] = frozenset({JobState.STARTING, JobState.RUNNING, JobState.SUSPENDED})
# States in which a job waits for the scheduler.
WAITING_STATES: frozenset[JobState] = frozenset({JobState.PENDING, JobState.HELD})

# Legal transitions; the store refuses anything else so a bug cannot silently corrupt a history.
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.STARTING, JobState.HELD, JobState.CANCELLED, JobState.FAILED}),
    JobState.HELD: frozenset({JobState.PENDING, JobState.CANCELLED, JobState.FAILED}),
    JobState.STARTING: frozenset(
        {JobState.RUNNING, JobState.FAILED, JobState.CANCELLED, JobState.LOST, JobState.PENDING}
    ),
    JobState.RUNNING: frozenset(
        {
            JobState.COMPLETED,
            JobState.FAILED,
            JobState.CANCELLED,
            JobState.TIMEOUT,
            JobState.LOST,
            JobState.SUSPENDED,
            JobState.PREEMPTED,
        }
    ),
    JobState.SUSPENDED: frozenset(
        {JobState.RUNNING, JobState.CANCELLED, JobState.FAILED, JobState.TIMEOUT, JobState.LOST,
         JobState.COMPLETED, JobState.PREEMPTED}
    ),
    JobState.PREEMPTED: frozenset({JobState.PENDING, JobState.CANCELLED}),
    JobState.COMPLETED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
    JobState.TIMEOUT: frozenset(),
    JobState.LOST: frozenset(),
}


# Job ids are SQLite INTEGER primary keys: anything outside int64 can never name a job.
JobId = Annotated[int, Field(ge=1, le=2**63 - 1)]
MAX_SPEC_BYTES = 256 * 1024  # argv + environment + cwd + name: a show or wait reply must still fit in one frame
# Each string is charged its UTF-8 bytes plus a terminating NUL and a pointer, as execve(2) charges
# ARG_MAX: an argv of 100,000 empty strings is not free to hold in memory, so it must not count as 0.
SPEC_STRING_OVERHEAD = 9
MAX_DISPLAY_NAME = 64  # characters of a job's name in listings (`queue`, `top`); the full name is in `show`


def utf8_len(text: str) -> int:
    """Bytes `text` takes on the wire and in the database (lone surrogates count as 3, as UTF-8 would)."""
    return len(text.encode("utf-8", "surrogatepass"))


def bounded(text: str, limit: int) -> str:
    """`text` cut to at most `limit` characters, with an ellipsis when something was cut."""
    return text if len(text) <= limit else text[: max(0, limit - 1)] + "\u2026"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class WholeRequest(_Frozen):
    """`--gpus N`: N whole GPUs with MIG off."""

    kind: Literal["whole"] = "whole"
    gpus: int = Field(ge=1, le=64, description="number of whole GPUs")


class MigRequest(_Frozen):
    """`--mig PROFILE`: one MIG instance of the named profile (e.g. `3g.40gb`)."""

    kind: Literal["mig"] = "mig"
    profile: str = Field(min_length=1, max_length=32, pattern=r"^[0-9]+g\.[0-9]+gb(\+me)?$")


class ShareRequest(_Frozen):
    """`--share F --gpu-mem SIZE`: a fraction of a device's SMs with a memory cap."""

    kind: Literal["share"] = "share"
    fraction: float = Field(gt=0.0, le=1.0, description="fraction of the device's compute")
    gpu_mem_mib: int = Field(ge=1, description="GPU memory cap in MiB")


class PartitionRequest(_Frozen):
    """`--partition MODE [--gpus N]`: N logical GPUs of an AMD Instinct GPU in compute mode MODE.

    Hardware isolation on AMD (each logical GPU has its own XCDs and memory); the scheduler changes
    an idle physical GPU's mode from demand (docs/scheduling.md, "AMD partitions"). Refused on NVIDIA.
    """

    kind: Literal["partition"] = "partition"
    mode: Literal["SPX", "DPX", "QPX", "CPX"] = Field(description="compute partition mode of the logical GPUs")
    gpus: int = Field(default=1, ge=1, le=64, description="number of logical GPUs in that mode")


AnyRequest = WholeRequest | MigRequest | ShareRequest | PartitionRequest
ResourceRequest = Annotated[AnyRequest, Field(discriminator="kind")]

class Dependency(_Frozen):
    """`--after ID[:ok|any]`: start only after job ID has ended (`ok`: ended COMPLETED)."""

    job_id: JobId
    condition: Literal["ok", "any"] = "ok"


JobClass = Literal["batch", "interactive"]
Precision = Literal["fp16", "bf16", "fp32", "tf32"]


class JobSpec(_Frozen):
    """Everything the submitter decided about a job. Immutable once acknowledged."""

    argv: list[str] = Field(min_length=1, description="program and arguments, run without a shell")
    cwd: str = Field(min_length=1, description="absolute working directory")
    env: dict[str, str] = Field(default_factory=dict, description="environment the job starts with")
    request: ResourceRequest
    name: str | None = Field(default=None, max_length=128)
    time_limit_s: float | None = Field(default=None, gt=0, allow_inf_nan=False,  # inf would be stored as null
                                       description="wall-clock limit in seconds")
    job_class: JobClass = "batch"
    nice: int = Field(default=0, ge=0, le=19)
    requeue: bool = False
    precision: Precision | None = None
    after: list[Dependency] = Field(default_factory=list, max_length=64)
    cpus: int | None = Field(default=None, ge=1, le=4096, description="host CPU cores")
    # at most what memory.max takes: a bigger one could only fail at launch
    mem_mib: int | None = Field(default=None, ge=1, le=MAX_MEM_MIB, description="host memory limit in MiB")

    @field_validator("cwd")
    @classmethod
    def _absolute_cwd(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must be an absolute path")
        return value

    @field_validator("argv")
    @classmethod
    def _no_nul(cls, value: list[str]) -> list[str]:
        if any("\x00" in part for part in value):
            raise ValueError("arguments must not contain NUL bytes")
        return value

    @model_validator(mode="after")
    def _bounded(self) -> JobSpec:
        size = spec_bytes(self)
        if size > MAX_SPEC_BYTES:
            raise ValueError(f"argv, environment, cwd and name take {size} bytes; at most {MAX_SPEC_BYTES} are "
                             "accepted (submit with --export NONE or fewer variables)")
        return self


def spec_bytes(spec: JobSpec) -> int:
    """What a spec costs against MAX_SPEC_BYTES: UTF-8 bytes of every string, plus SPEC_STRING_OVERHEAD each.

    Bytes, not characters: 255k four-byte characters are 1 MB on the wire and in memory.
    """
    global _last_measured
    last = _last_measured
    if last[0] is spec:  # a spec is frozen: the validator measured it, the per-user limits ask again
        return last[1]
    env = spec.env
    # A variable is `NAME=value`: its name and value, and one byte for the `=` (added below), without
    # making each string. One join, and an encode only for text that is not ASCII (each character one byte).
    strings = [*spec.argv, spec.cwd, *env, *env.values()]
    if spec.name is not None:
        strings.append(spec.name)
    text = "".join(strings)
    count = len(strings) - len(env)  # strings of the spec: a variable's name and value are one
    size = (len(text) if text.isascii() else utf8_len(text)) + len(env) + SPEC_STRING_OVERHEAD * count
    _last_measured = (spec, size)
    return size


# The spec measured last, and its size: a submit's spec is measured by its validator and again by the
# daemon's per-user limit on the same object, an eighth of a submit's parsing (one spec kept alive).
_last_measured: tuple[JobSpec | None, int] = (None, 0)


class AllocatedDevice(_Frozen):
    """One device a job was given: a whole GPU or a MIG instance."""

    uuid: str
    gpu_index: int
    kind: Literal["gpu", "mig"]
    profile: str | None = None


class Allocation(_Frozen):
    """What a job got. `compute_fraction` is what its owner is charged per second of wall time."""

    devices: list[AllocatedDevice]
    compute_fraction: float = Field(ge=0.0)
    share: float | None = None
    gpu_mem_mib: int | None = None
    env: dict[str, str] = Field(default_factory=dict)

    @property
    def uuids(self) -> list[str]:
        return [d.uuid for d in self.devices]


class Transition(_Frozen):
    """One committed state change, with its reason and time (epoch seconds)."""

    state: JobState
    at: float
    reason: str


class Job(BaseModel):
    """A job as the store keeps it and clients see it."""

    model_config = ConfigDict(extra="forbid")

    id: int
    uid: int
    gid: int
    user: str
    spec: JobSpec
    state: JobState
    submitted_at: float
    started_at: float | None = None
    ended_at: float | None = None
    exit_code: int | None = None
    signal: int | None = None
    reason: str = ""
    allocation: Allocation | None = None
    pid: int | None = None
    history: list[Transition] = Field(default_factory=list)
    # The job array this job is a task of, and its index there (GPUSCHED_ARRAY_TASK_ID). Left out of
    # messages when unset: a protocol 1.0 client refuses members it does not know.
    array_id: int | None = Field(default=None, exclude_if=lambda v: v is None)
    array_task: int | None = Field(default=None, exclude_if=lambda v: v is None)

    @property
    def display_name(self) -> str:
        return display_name(self.spec)


def pending_since(job: Job) -> float:
    """When the job last became PENDING (submission, release from hold or requeue): its wait starts
    there. Read off its history, so a restarted daemon and its fresh scheduler see the same wait."""
    for transition in reversed(job.history):
        if transition.state is JobState.PENDING:
            return transition.at
    return job.submitted_at


def display_name(spec: JobSpec) -> str:
    """The name listings show: `--name`, else the program's base name, at most MAX_DISPLAY_NAME characters
    (argv[0] may be 256 KiB long; five such rows must not break `queue` for everyone)."""
    return bounded(spec.name or spec.argv[0].rsplit("/", 1)[-1], MAX_DISPLAY_NAME)


def describe_request(request: AnyRequest) -> str:
    """A short human form of a request, as the CLI writes it (`gpus=2`, `mig=3g.40gb`, ...)."""
    if isinstance(request, WholeRequest):
        return f"gpus={request.gpus}"
    if isinstance(request, MigRequest):
        return f"mig={request.profile}"
    if isinstance(request, PartitionRequest):
        return f"partition={request.mode.lower()}" + (f",gpus={request.gpus}" if request.gpus > 1 else "")
    return f"share={request.fraction:g},mem={request.gpu_mem_mib}MiB"


class Event(_Frozen):
    """Something that happened to a device or job: an XID, a drain, a MIG change."""

    at: float
    # xid_app_error | gpu_fault | gpu_lost | drain | resume | mig_create | mig_destroy | mig_mode | checkpoint |
    # checkpoint_failed | restored | restore_move_failed | partition_mode
    kind: str
    message: str
    gpu: int | None = None
    device: str | None = None
    job_id: int | None = None


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
