"""`gpusched`: the command-line client. One click command per protocol request, same names.

This module turns flags into requests and results into output (via `render`), and maps every
failure to one documented exit code so scripts can branch on it (see `EXIT_CODES`, docs/cli.md).
It imports only gpusched.protocol / gpusched.model from the daemon's package: the client must start
fast and must not drag in the scheduler, NVML or asyncio.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import click
from pydantic import BaseModel, ValidationError

from gpusched.arrayspec import ArraySpecError, parse_array_spec, parse_job_ref
from gpusched.model import (
    Dependency,
    Job,
    JobSpec,
    JobState,
    MigRequest,
    ResourceRequest,
    ShareRequest,
    WholeRequest,
)
from gpusched.protocol import (
    PROTOCOL_VERSION,
    CancelRequest,
    CancelResult,
    DevicesChanged,
    DoctorRequest,
    DoctorResult,
    ErrorCode,
    GpuDrainRequest,
    GpuResumeRequest,
    GpusRequest,
    GpusResult,
    HoldRequest,
    JobsChanged,
    LogsRequest,
    LogsResult,
    MigApplyRequest,
    MigApplyResult,
    ProtocolError,
    QueueRequest,
    QueueResult,
    ReleaseRequest,
    ReloadRequest,
    ReloadResult,
    ResumeRequest,
    ShowRequest,
    ShowResult,
    ShutdownRequest,
    ShutdownResult,
    SimInjectXidRequest,
    SimResult,
    StatsRequest,
    StatsResult,
    SubmitRequest,
    SuspendRequest,
    TaskRef,
    WaitRequest,
    WaitResult,
    describe_validation_error,
)
from gpusched_cli import render, resubmit
from gpusched_cli.client import Client, DaemonUnavailable, resolve_socket
from gpusched_cli.parse import parse_dependencies, parse_duration_s, parse_export, parse_size_mib

# ---- exit codes ----------------------------------------------------------------------------------

EXIT_OK = 0
EXIT_ERROR = 1  # an error the daemon reported that has no code of its own
EXIT_USAGE = 2  # click's usage errors
EXIT_UNAVAILABLE = 3
EXIT_NOT_FOUND = 4
EXIT_PERMISSION = 5
EXIT_UNSATISFIABLE = 6
EXIT_VERSION = 7
EXIT_LIMIT = 8  # a per-user limit (pending jobs, submit rate): retry later

# `submit --wait` exits with the job's own status; these stand for endings that have none.
# 124/125 follow coreutils `timeout` (124: timed out; 125: the command itself could not run).
EXIT_JOB_CANCELLED = 122
EXIT_JOB_LOST = 123
EXIT_JOB_TIMEOUT = 124
EXIT_JOB_NOT_RUN = 125
EXIT_INTERRUPTED = 130  # Ctrl-C while waiting or following (128 + SIGINT); the job keeps going

_CODE_EXITS: dict[ErrorCode, int] = {
    ErrorCode.NOT_FOUND: EXIT_NOT_FOUND,
    ErrorCode.PERMISSION_DENIED: EXIT_PERMISSION,
    ErrorCode.UNSATISFIABLE: EXIT_UNSATISFIABLE,
    ErrorCode.VERSION_MISMATCH: EXIT_VERSION,
    ErrorCode.LIMIT_EXCEEDED: EXIT_LIMIT,
    ErrorCode.SHUTTING_DOWN: EXIT_UNAVAILABLE,
}

EXIT_CODES_HELP = """\b
Exit codes:
  0  success
  1  error reported by the daemon (bad request, invalid state, internal, ...)
  2  usage error (bad flags or arguments)
  3  daemon not running, unreachable or shutting down (the message names the socket)
  4  no such job
  5  permission denied (e.g. another user's job, admin-only command)
  6  request can never be satisfied on this node (e.g. more GPUs than it has)
  7  client and daemon protocol versions differ
  8  a per-user limit was hit (pending jobs, submit rate); try again later
\b
submit --wait exits with the job's own exit code, or:
  128+N  the job was killed by signal N
  122    the job was cancelled
  123    the job was lost (its process vanished, e.g. daemon host crash)
  124    the job hit its time limit
  125    the job failed before its program ran (no exit status)
  130    interrupted (Ctrl-C) while waiting; the job keeps running
\b
Socket: --socket PATH, else $GPUSCHED_SOCKET, else the first of
/run/gpusched/gpusched.sock, $XDG_RUNTIME_DIR/gpusched/gpusched.sock,
/tmp/gpusched-$UID/gpusched.sock that exists. See docs/cli.md."""


def job_exit_status(job: Job) -> int:
    """The exit status `submit --wait` gives for a finished job (see EXIT_CODES_HELP)."""
    if job.state is JobState.TIMEOUT:
        return EXIT_JOB_TIMEOUT
    if job.state is JobState.CANCELLED:
        return EXIT_JOB_CANCELLED
    if job.state is JobState.LOST:
        return EXIT_JOB_LOST
    if job.signal is not None:
        return 128 + job.signal
    if job.exit_code is not None:
        return job.exit_code & 0xFF if job.exit_code >= 0 else EXIT_JOB_NOT_RUN
    return EXIT_OK if job.state is JobState.COMPLETED else EXIT_JOB_NOT_RUN


def _echo(message: str, err: bool = False) -> None:
    """Print for people: every character a terminal would act on is escaped (render.printable), since
    names, commands, reasons and even error messages can carry other users' text."""
    click.echo(render.printable(message), err=err)


def _fail(message: str, hint: str, code: int) -> NoReturn:
    _echo(f"error: {message}", err=True)
    if hint:
        _echo(f"hint: {hint}", err=True)
    sys.exit(code)


class _Cli(click.Group):
    """Maps every failure of a command to its exit code and an `error:`/`hint:` pair on stderr."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except DaemonUnavailable as exc:
            _fail(exc.message, exc.hint, EXIT_UNAVAILABLE)
        except ProtocolError as exc:
            _fail(exc.message, exc.hint, _CODE_EXITS.get(exc.code, EXIT_ERROR))
        except (TimeoutError, ConnectionError) as exc:
            path = ctx.obj.get("socket_path", "the daemon socket") if isinstance(ctx.obj, dict) else "socket"
            _fail(
                f"lost the connection to gpuschedd on {path}: {exc}",
                "the daemon may be overloaded or restarting; try again",
                EXIT_UNAVAILABLE,
            )


@contextmanager
def _client(ctx: click.Context, timeout: float = 60.0) -> Iterator[Client]:
    """A connected client on the socket chosen by --socket / $GPUSCHED_SOCKET / discovery."""
    obj = ctx.find_root().obj
    path = resolve_socket(obj.get("socket"))
    obj["socket_path"] = path
    client = Client(path, timeout=timeout)
    try:
        client.connect()  # not `with Client(...)`: a refused hello would leave the socket open
        yield client
    finally:
        client.close()


def _print_json(data: Any, compact: bool = False) -> None:
    if isinstance(data, BaseModel):
        data = data.model_dump(mode="json")
    _echo(json.dumps(data, separators=(",", ":")) if compact else json.dumps(data, indent=2))


def _write_verbatim(text: str) -> None:
    """Log text exactly as the job wrote it: no ANSI stripping (click.echo would), no re-encoding."""
    sys.stdout.flush()
    sys.stdout.buffer.write(text.encode("utf-8", "surrogateescape"))
    sys.stdout.buffer.flush()


# ---- the group -----------------------------------------------------------------------------------


@click.group(cls=_Cli, epilog=EXIT_CODES_HELP, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--socket",
    "socket_path",
    metavar="PATH",
    help="daemon socket (default: $GPUSCHED_SOCKET, else the system or your own daemon's socket)",
)
@click.version_option(
    package_name="gpusched",
    prog_name="gpusched",
    message=f"%(prog)s %(version)s (protocol {PROTOCOL_VERSION})",
)
@click.pass_context
def cli(ctx: click.Context, socket_path: str | None) -> None:
    """Submit GPU jobs to gpuschedd and watch them: whole GPUs, MIG instances or MPS shares."""
    ctx.ensure_object(dict)
    ctx.obj["socket"] = socket_path


# ---- submit --------------------------------------------------------------------------------------


# Flag values are converted in callbacks rather than click.ParamType subclasses: ParamType became
# generic in click 8.2+, and callbacks type-check the same on every click we support.


def _size_flag(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    try:
        return None if value is None else parse_size_mib(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


def _time_flag(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    try:
        return None if value is None else parse_duration_s(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


def _after_flag(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> list[Dependency]:
    try:
        return [Dependency(job_id=i, condition=c) for text in value for i, c in parse_dependencies(text)]
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


def _fraction_flag(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    if value is None:
        return None
    text = value.strip()
    try:
        fraction = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is not a fraction; use a number in (0, 1] such as 0.25, or a percentage: 25%",
            ctx,
            param,
        ) from None
    if not 0.0 < fraction <= 1.0:
        raise click.BadParameter(
            f"{value!r} must be more than 0 and at most 1 (a fraction of one GPU's compute)", ctx, param
        )
    return fraction


def _array_flag(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    try:
        return None if value is None else parse_array_spec(value).text
    except ArraySpecError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


def _job_refs(ctx: click.Context, param: click.Parameter, value: tuple[str, ...] | str) -> Any:
    """ID or ARRAY_TASK (`123_7`) -> (id, task or None); one or many, as the argument takes."""
    try:
        refs = [parse_job_ref(text) for text in ((value,) if isinstance(value, str) else value)]
    except ArraySpecError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None
    return refs[0] if isinstance(value, str) else refs


_MIG_PROFILE = re.compile(r"^[0-9]+g\.[0-9]+gb(\+me)?$")


def _check_mig(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and not _MIG_PROFILE.match(value):
        raise click.BadParameter(
            f"{value!r} is not a MIG profile; profiles look like 1g.10gb, 3g.40gb, 7g.80gb "
            "(`gpusched gpus` shows the ones in use)",
            ctx,
            param,
        )
    return value


def build_request(
    gpus: int | None, mig: str | None, share: float | None, gpu_mem_mib: int | None
) -> ResourceRequest:
    """Exactly one of --gpus / --mig / --share+--gpu-mem; the error names the flags involved."""
    chosen = [flag for flag, v in (("--gpus", gpus), ("--mig", mig), ("--share", share)) if v is not None]
    if len(chosen) != 1:
        said = f"got {' and '.join(chosen)}" if chosen else "got none"
        raise click.UsageError(
            f"choose exactly one of --gpus N, --mig PROFILE or --share F --gpu-mem SIZE ({said})"
        )
    if gpu_mem_mib is not None and share is None:
        raise click.UsageError(
            "--gpu-mem SIZE goes with --share F (whole GPUs and MIG instances bring their own memory)"
        )
    if gpus is not None:
        return WholeRequest(gpus=gpus)
    if mig is not None:
        return MigRequest(profile=mig)
    assert share is not None
    if gpu_mem_mib is None:
        raise click.UsageError("--share F needs --gpu-mem SIZE, the GPU memory cap of the share (e.g. 10G)")
    return ShareRequest(fraction=share, gpu_mem_mib=gpu_mem_mib)


@cli.command(context_settings={"allow_interspersed_args": False})
@click.option("--gpus", type=click.IntRange(1, 64), help="N whole GPUs")
@click.option("--mig", metavar="PROFILE", callback=_check_mig, help="one MIG instance, e.g. 3g.40gb")
@click.option("--share", metavar="F", callback=_fraction_flag,
              help="a fraction of one GPU's compute (MPS), e.g. 0.25 or 25%; needs --gpu-mem")
@click.option("--gpu-mem", "gpu_mem", metavar="SIZE", callback=_size_flag,
              help="GPU memory cap with --share: 10G, 512M, 1.5GiB, 1024 (MiB)")
@click.option("--name", help="job name (default: the program's name)")
@click.option("--time", "time_limit", metavar="TIME", callback=_time_flag,
              help="time limit: minutes, M:S, H:M:S, D-H:M:S, or 30s / 5m / 2h / 1d")
@click.option("--class", "job_class", type=click.Choice(["batch", "interactive"]), default="batch",
              show_default=True, help="interactive jobs start sooner, without a bigger share")
@click.option("--nice", type=click.IntRange(0, 19), default=0, show_default=True,
              help="lower the job's priority among your own jobs")
@click.option("--requeue", is_flag=True, help="put the job back in the queue if it is preempted")
@click.option("--after", multiple=True, metavar="ID[:ok|any]", callback=_after_flag,
              help="start only after job ID ended (ok: COMPLETED, the default; any: however); repeatable")
@click.option("--cpus", type=click.IntRange(1, 4096), help="host CPU cores for the job")
@click.option("--mem", "mem", metavar="SIZE", callback=_size_flag, help="host memory limit: 32G, 512M, ...")
@click.option("--hold", is_flag=True, help="submit held: the job starts only after `gpusched release`")
@click.option("--array", "array", metavar="A-B[:STEP][,...][%MAX]", callback=_array_flag,
              help="a job array as sbatch: one task per index (GPUSCHED_ARRAY_TASK_ID), at most MAX running at once")
@click.option("--export", "export", default="ALL", show_default=True, metavar="ALL|NONE|VAR[=VAL],...",
              help="the job's environment, as sbatch: all of yours, none, or only the listed variables")
@click.option("--precision", type=click.Choice(["fp16", "bf16", "fp32", "tf32"]),
              help="prefer GPUs that are fast at this precision")
@click.option("--wait", is_flag=True, help="block until the job ends and exit with its exit code")
@click.option("--json", "as_json", is_flag=True, help='print {"job_id": N, "state": S}')
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED, metavar="-- CMD [ARGS]...")
@click.pass_context
def submit(
    ctx: click.Context,
    gpus: int | None,
    mig: str | None,
    share: float | None,
    gpu_mem: int | None,
    name: str | None,
    time_limit: int | None,
    job_class: str,
    nice: int,
    requeue: bool,
    after: list[Dependency],
    cpus: int | None,
    mem: int | None,
    hold: bool,
    array: str | None,
    export: str,
    precision: str | None,
    wait: bool,
    as_json: bool,
    command: tuple[str, ...],
) -> None:
    """Queue CMD (run without a shell, in this directory, with this environment).

    \b
    Examples:
      gpusched submit --gpus 2 --time 4:00:00 -- python train.py --lr 3e-4
      gpusched submit --mig 3g.40gb --name eval -- ./eval.sh
      gpusched submit --share 0.25 --gpu-mem 10G --wait -- python infer.py
      gpusched submit --gpus 1 --array 0-99%8 -- python sweep.py   # task i reads $GPUSCHED_ARRAY_TASK_ID
    """
    if array is not None and wait:
        raise click.UsageError("--wait waits for one job; with --array, wait with `gpusched queue` or `show ID`")
    request = build_request(gpus, mig, share, gpu_mem)
    try:
        env = parse_export(export, os.environ)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--export") from None
    try:
        spec = JobSpec(
            argv=list(command),
            cwd=os.getcwd(),
            env=env,
            request=request,
            name=name,
            time_limit_s=time_limit,
            job_class=job_class,  # type: ignore[arg-type]  # click.Choice guarantees the literal
            nice=nice,
            requeue=requeue,
            precision=precision,  # type: ignore[arg-type]
            after=after,
            cpus=cpus,
            mem_mib=mem,
        )
    except ValidationError as exc:
        raise click.UsageError(describe_validation_error(exc)) from None

    with _client(ctx) as client:
        submitted = resubmit.submit(client, SubmitRequest(spec=spec, hold=hold, array=array,
                                                          request_id=resubmit.new_request_id()))
        try:  # from here on Ctrl-C only stops the waiting: say so, and which job lives on
            if as_json:
                _print_json({"job_id": submitted.job_id, "state": submitted.state.value}
                            | ({"tasks": submitted.tasks} if submitted.tasks is not None else {}), compact=True)
            elif submitted.tasks is not None:
                _echo(f"Submitted array job {submitted.job_id} ({submitted.tasks} tasks: {submitted.job_id}_[{array}])")
            else:
                _echo(f"Submitted job {submitted.job_id}")
            if not wait:
                return
            job = _wait_for(client, submitted.job_id)
        except KeyboardInterrupt:
            _echo(
                f"\nStopped waiting; job {submitted.job_id} keeps running "
                f"(`gpusched cancel {submitted.job_id}` to stop it)",
                err=True,
            )
            sys.exit(EXIT_INTERRUPTED)
    status = job_exit_status(job)
    if as_json:
        _print_json(
            {"job_id": job.id, "state": job.state.value, "exit_code": job.exit_code, "signal": job.signal,
             "exit_status": status},
            compact=True,
        )
    else:
        _echo(render.final_state_text(job), err=True)
    sys.exit(status)


def _wait_for(client: Client, job_id: int) -> Job:
    """Long-poll `wait` until the job is in a final state (a requeued job is waited through)."""
    while True:
        result = client.call(WaitRequest(job_id=job_id, timeout_s=30.0), WaitResult)
        if result.finished:
            return result.job


# ---- queue / show / logs / cancel / gpus / shutdown ----------------------------------------------


@cli.command()
@click.option("--all", "show_all", is_flag=True,
              help="include finished jobs (those the daemon still keeps: see finished_job_retention_s)")
@click.option("--user", metavar="USER", help="only this user's jobs")
@click.option("--order", type=click.Choice(["id", "fairness"]), default="id", show_default=True,
              help="fairness: pending jobs in the order the scheduler would start them")
@click.option("--limit", type=click.IntRange(1, 3000), default=1000, show_default=True,
              help="at most this many rows")
@click.option("--array-tasks", "array_tasks", is_flag=True,
              help="one row per array task (ARRAY_TASK) instead of one row per array")
@click.option("--json", "as_json", is_flag=True, help='print {"jobs": [...], "total": N, "arrays": [...]} '
              "(see docs/cli.md)")
@click.pass_context
def queue(ctx: click.Context, show_all: bool, user: str | None, order: str, limit: int, array_tasks: bool,
          as_json: bool) -> None:
    """List pending and running jobs (with --all, finished ones too); an array is one row."""
    labels: dict[str, str] = {}
    with _client(ctx) as client:
        request = QueueRequest(all=show_all, user=user, order=order, limit=limit,  # type: ignore[arg-type]
                               array_tasks=array_tasks)
        result = client.call(request, QueueResult)
        if not as_json and any(job.devices for job in result.jobs):
            labels = render.device_labels(client.call(GpusRequest(), GpusResult))
    if as_json:
        _print_json(result)
    else:
        _echo(render.queue_table(result.jobs, time.time(), labels, result.arrays))
        if result.total > len(result.jobs):
            _echo(f"... {result.total - len(result.jobs)} more not shown (narrow with --user, or --limit up "
                       "to 3000)")


@cli.command()
@click.argument("ref", callback=_job_refs, metavar="ID|ARRAY_TASK")
@click.option("--json", "as_json", is_flag=True, help="print the daemon's ShowResult (see docs/cli.md)")
@click.pass_context
def show(ctx: click.Context, ref: tuple[int, int | None], as_json: bool) -> None:
    """Everything about one job (or array task, 123_7): spec, state history, allocation, exit status, log path.
    An array's id shows the array's counts and its first unfinished task."""
    with _client(ctx) as client:
        result = client.call(ShowRequest(job_id=ref[0], task=ref[1]), ShowResult)
    if as_json:
        _print_json(result)
    else:
        _echo(render.show_text(result, time.time()))


@cli.command()
@click.argument("ref", callback=_job_refs, metavar="ID|ARRAY_TASK")
@click.option("-f", "--follow", is_flag=True, help="keep printing new output until the job ends")
@click.pass_context
def logs(ctx: click.Context, ref: tuple[int, int | None], follow: bool) -> None:
    """Print a job's (or array task's, 123_7) combined stdout and stderr, verbatim."""
    job_id, task = ref
    offset = 0
    try:
        with _client(ctx) as client:
            while True:
                chunk = client.call(
                    LogsRequest(job_id=job_id, task=task, offset=offset, wait_s=10.0 if follow else 0.0), LogsResult
                )
                if chunk.data:
                    _write_verbatim(chunk.data)
                advanced = chunk.next_offset != offset
                offset = chunk.next_offset
                if chunk.eof or (not follow and not advanced):
                    return
    except KeyboardInterrupt:
        sys.exit(EXIT_INTERRUPTED)


@cli.command()
@click.argument("refs", nargs=-1, required=True, callback=_job_refs, metavar="ID|ARRAY_TASK...")
@click.pass_context
def cancel(ctx: click.Context, refs: list[tuple[int, int | None]]) -> None:
    """Cancel jobs: pending ones leave the queue, running ones are stopped. An array's id cancels
    all its tasks; ARRAY_TASK (123_7) one of them."""
    request = CancelRequest(job_ids=[i for i, t in refs if t is None],
                            tasks=[TaskRef(array_id=i, task=t) for i, t in refs if t is not None])
    with _client(ctx) as client:
        result = client.call(request, CancelResult)
    _echo(render.cancel_text(result))


def _job_control(ctx: click.Context, request: BaseModel, done: str) -> None:
    with _client(ctx) as client:
        result = client.call(request, JobsChanged)
    _echo(render.changed_text(done, result))


_IDS = click.argument("job_ids", nargs=-1, required=True, type=click.IntRange(min=1), metavar="ID [ID]...")


@cli.command()
@_IDS
@click.pass_context
def suspend(ctx: click.Context, job_ids: tuple[int, ...]) -> None:
    """Pause running jobs (SIGSTOP); they keep their devices and GPU memory."""
    _job_control(ctx, SuspendRequest(job_ids=list(job_ids)), "Suspended")


@cli.command()
@_IDS
@click.pass_context
def resume(ctx: click.Context, job_ids: tuple[int, ...]) -> None:
    """Continue suspended jobs (SIGCONT)."""
    _job_control(ctx, ResumeRequest(job_ids=list(job_ids)), "Resumed")


@cli.command()
@_IDS
@click.pass_context
def hold(ctx: click.Context, job_ids: tuple[int, ...]) -> None:
    """Keep pending jobs from starting until they are released."""
    _job_control(ctx, HoldRequest(job_ids=list(job_ids)), "Held")


@cli.command()
@_IDS
@click.pass_context
def release(ctx: click.Context, job_ids: tuple[int, ...]) -> None:
    """Let held jobs start again."""
    _job_control(ctx, ReleaseRequest(job_ids=list(job_ids)), "Released")


@cli.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="print the daemon's GpusResult (see docs/cli.md)")
@click.pass_context
def gpus(ctx: click.Context, as_json: bool) -> None:
    """The node's GPUs: memory, MIG mode and instances, health, and whose jobs run where.

    With a subcommand, an administrator drains a device or resumes it.
    """
    if ctx.invoked_subcommand is not None:
        return
    with _client(ctx) as client:
        result = client.call(GpusRequest(), GpusResult)
    if as_json:
        _print_json(result)
    else:
        _echo(render.gpus_text(result))


@gpus.command("drain")
@click.argument("device", metavar="DEVICE")
@click.option("--reason", default="", help="why, shown in `gpusched gpus`")
@click.pass_context
def gpus_drain(ctx: click.Context, device: str, reason: str) -> None:
    """Admin: no new job starts on DEVICE (GPU index, GPU- or MIG- UUID); running jobs continue."""
    with _client(ctx) as client:
        result = client.call(GpuDrainRequest(device=device, reason=reason), DevicesChanged)
    _echo(result.message)
    for uuid in result.devices:
        _echo(f"  {uuid}")


@gpus.command("resume")
@click.argument("device", metavar="DEVICE")
@click.pass_context
def gpus_resume(ctx: click.Context, device: str) -> None:
    """Admin: put a drained DEVICE (GPU index, GPU- or MIG- UUID) back in service."""
    with _client(ctx) as client:
        result = client.call(GpuResumeRequest(device=device), DevicesChanged)
    _echo(result.message)
    for uuid in result.devices:
        _echo(f"  {uuid}")


@cli.group()
def mig() -> None:
    """MIG layouts (admin)."""


@mig.command("apply")
@click.argument("gpu", type=click.IntRange(min=0), metavar="GPU")
@click.argument("layout", metavar="LAYOUT")
@click.option("--dry-run", is_flag=True, help="show what would change, change nothing")
@click.option("--json", "as_json", is_flag=True, help="print the daemon's MigApplyResult")
@click.pass_context
def mig_apply(ctx: click.Context, gpu: int, layout: str, dry_run: bool, as_json: bool) -> None:
    """Make GPU hold exactly LAYOUT, e.g. `3g.40gb,2g.20gb,2g.20gb` (or `none`).

    Instances that already match are kept; only idle ones are destroyed; if a busy instance would
    have to go, nothing changes and the job holding it is named.
    """
    profiles = [] if layout.strip().lower() == "none" else [p.strip() for p in layout.split(",") if p.strip()]
    with _client(ctx) as client:
        result = client.call(MigApplyRequest(gpu=gpu, layout=profiles, dry_run=dry_run), MigApplyResult)
    if as_json:
        _print_json(result)
        return
    verb = "would" if dry_run else "did"
    _echo(f"GPU {gpu}: keep {len(result.keep)}, destroy {len(result.destroy)}, create {len(result.create)}"
               f" ({'dry run' if dry_run else 'applied'})")
    for uuid in result.destroy:
        _echo(f"  {verb} destroy {uuid}")
    for planned in result.create:
        _echo(f"  {verb} create {planned.profile} at memory slice {planned.start}")


@cli.group()
def sim() -> None:
    """Simulated GPUs only (gpuschedd --sim): fault injection for trying out and testing."""


@sim.command("inject-xid")
@click.argument("gpu", type=click.IntRange(min=0), metavar="GPU")
@click.argument("xid", type=click.IntRange(1, 1000), metavar="XID")
@click.option("--gi", type=click.IntRange(min=0), help="scope to this MIG GPU instance id")
@click.option("--ci", type=click.IntRange(min=0), help="scope to this MIG compute instance id")
@click.option("--lost", is_flag=True, help="make the GPU fall off the bus instead")
@click.pass_context
def sim_inject_xid(ctx: click.Context, gpu: int, xid: int, gi: int | None, ci: int | None, lost: bool) -> None:
    """Admin: deliver XID on simulated GPU as the driver would (13, 31, 43, 45, 68, 109 are app errors)."""
    with _client(ctx) as client:
        result = client.call(SimInjectXidRequest(gpu=gpu, xid=xid, gi=gi, ci=ci, lost=lost), SimResult)
    _echo(result.message)


@cli.command()
@click.option("--once", is_flag=True, help="print one snapshot and exit (for scripts)")
@click.option("--width", type=click.IntRange(40, 1000), default=120, show_default=True,
              help="line width for --once")
@click.pass_context
def top(ctx: click.Context, once: bool, width: int) -> None:
    """Live view: GPUs and their MIG slices, running jobs, the queue by user, recent events.

    Keys: q quit, s cycle sort (id, user, runtime, memory), u filter by user, p pause.
    The daemon pushes a new picture whenever something changes.
    """
    from gpusched_cli import top as top_view  # curses is only needed here

    with _client(ctx, timeout=30.0) as client:
        if once:
            snapshot = top_view.first_snapshot(client)
            _echo("\n".join(top_view.render_top(snapshot, top_view.View(), width=width)))
            return
        top_view.run_live(client)


@cli.command()
@click.option("--since", "since", default="1h", show_default=True, metavar="TIME",
              help="window length: 30m, 1h, 2d, or Slurm's forms (90 = 90 minutes)")
@click.option("--json", "as_json", is_flag=True, help="print the daemon's StatsResult (see docs/cli.md)")
@click.pass_context
def stats(ctx: click.Context, since: str, as_json: bool) -> None:
    """Per-user service, share vs entitled share, waits; Jain's fairness index; device use."""
    try:
        window = parse_duration_s(since)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--since") from None
    with _client(ctx) as client:
        result = client.call(StatsRequest(since_s=window), StatsResult)
    if as_json:
        _print_json(result)
    else:
        _echo(render.stats_text(result))


@cli.command()
@click.option("--json", "as_json", is_flag=True, help='print {"checks": [{name, status, detail, hint}]}')
@click.pass_context
def doctor(ctx: click.Context, as_json: bool) -> None:
    """Check the node as an admin would: driver, MIG modes, foreign CUDA processes, cgroups, permissions.

    Exits 1 when any check FAILs (WARNs alone exit 0).
    """
    with _client(ctx) as client:
        result = client.call(DoctorRequest(), DoctorResult)
    if as_json:
        _print_json(result)
    else:
        _echo(render.doctor_text(result))
    if any(c.status == "FAIL" for c in result.checks):
        ctx.exit(EXIT_ERROR)


@cli.group()
def admin() -> None:
    """Administration of the daemon itself."""


@admin.command("reload")
@click.pass_context
def admin_reload(ctx: click.Context) -> None:
    """Re-read the daemon's config file (like `systemctl reload gpusched`).

    Weights and quanta apply at once and nobody loses their place in the queue; settings bound to
    resources (socket, state_dir, sim, cgroup_root, metrics address) need a restart and are listed.
    A bad file is refused with the reason and the daemon keeps its previous configuration.
    """
    with _client(ctx) as client:
        result = client.call(ReloadRequest(), ReloadResult)
    _echo("reloaded: " + (", ".join(result.changed) if result.changed else "no changes"))
    if result.restart_needed:
        _echo("needs a restart to take effect: " + ", ".join(result.restart_needed))


@cli.command()
@click.pass_context
def shutdown(ctx: click.Context) -> None:
    """Ask the daemon to stop (admin only). Running jobs are handled by its shutdown policy."""
    with _client(ctx) as client:
        result = client.call(ShutdownRequest(), ShutdownResult)
    _echo("gpuschedd is stopping" if result.stopping else "gpuschedd did not agree to stop")


@cli.command()
@click.argument("trace", type=click.Path(exists=True, dir_okay=False))
@click.option("--format", "fmt", type=click.Choice(["auto", "csv", "alibaba"]), default="auto", show_default=True,
              help="trace format; auto looks at the header")
@click.option("--gpus", default="H100-80GB:8", show_default=True, metavar="MODEL:COUNT[,...]",
              help="simulated node, as gpuschedd --sim; models: A100-40GB, A100-80GB, H100-80GB, H100-PCIe, "
              "H100-NVL, H200, GH200-96GB, GH200-144GB")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="replay TOML: [fairness] [scheduler] [mig] [replay] [interference] (docs/replay.md)")
@click.option("--policy", default="all", show_default=True,
              help="gpusched, fifo-whole, fifo-timeslice, static-mig, or all")
@click.option("--load", type=float, default=None, help="scale arrivals to this offered load (alibaba default 0.9)")
@click.option("--users", type=click.IntRange(1, 100000), default=16, show_default=True,
              help="alibaba: pods are spread over this many users (hash of name and seed)")
@click.option("--seed", type=int, default=1, show_default=True,
              help="alibaba: seed of the user assignment (and of the --times-from draw)")
@click.option("--times-from", "times_from", type=click.Path(exists=True, dir_okay=False), default=None,
              help="for an alibaba pod list without time columns (multigpu50): take arrival and run times "
                   "from FILE (e.g. openb_pod_list_default.csv), by pod name, else from a pod drawn by hash")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per policy, one per line (docs/replay.md)")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="write a PNG: utilization over time and service per user")
@click.pass_context
def replay(ctx: click.Context, trace: str, fmt: str, gpus: str, config_path: str | None, policy: str,
           load: float | None, users: int, seed: int, times_from: str | None, as_json: bool,
           plot_path: str | None) -> None:
    """Replay a job trace through the scheduler on simulated GPUs under a virtual clock (no daemon).

    Runs each policy on the same trace and prints their figures side by side. Exits 2 on a bad
    trace, config or option.
    """
    from gpusched.replay import runner  # heavy (core, simulator): only when this command runs
    from gpusched.replay.policies import ReplayConfigError
    from gpusched.replay.trace import TraceError

    try:
        report = runner.run_replay(trace, gpus=gpus, fmt=fmt, config_path=config_path,
                                   policies=runner.resolve_policies(policy), load=load, users=users, seed=seed,
                                   times_from=times_from)
    except TraceError as exc:
        _echo(f"gpusched: bad trace:\n{exc}", err=True)
        ctx.exit(EXIT_USAGE)
    except (ReplayConfigError, ValueError) as exc:
        _echo(f"gpusched: {exc}", err=True)
        ctx.exit(EXIT_USAGE)
    except OSError as exc:
        _echo(f"gpusched: {exc.filename or trace}: {exc.strerror}", err=True)
        ctx.exit(EXIT_USAGE)
    if as_json:
        for summary in report.summaries:
            _echo(json.dumps(summary))
    else:
        _echo(runner.render_table(report))
    if plot_path is not None:
        from gpusched.replay.plot import PlotUnavailable, write_plot

        try:
            write_plot(report, plot_path)
        except PlotUnavailable as exc:
            _echo(f"gpusched: {exc}", err=True)
            ctx.exit(EXIT_ERROR)
        if not as_json:
            _echo(f"plot written to {plot_path}")


def main() -> None:
    """Entry for `python -m gpusched_cli.main` with the program named as users know it."""
    cli(prog_name="gpusched")


if __name__ == "__main__":
    main()
