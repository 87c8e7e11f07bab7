"""`gpusched submit`: flags -> a JobSpec as plain JSON -> one `submit` request (and `--wait`).

The request carries a random request_id and is sent again across a daemon restart (resubmit.py);
`--array` makes it a job array, checked here with the daemon's own parser before anything is sent.

The spec is built as the JSON the JobSpec model would dump (gpusched_cli.messages), without
pydantic: the model is consulted only for a spec that might break one of its limits, so its message
still names the field (exit 2) and the common case stays fast.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any, Literal

import click

from gpusched.arrayspec import ArraySpecError, parse_array_spec
from gpusched.wire import MIN_SHARE
from gpusched_cli import messages, render, resubmit
from gpusched_cli.client import Client
from gpusched_cli.common import connected, echo, print_json
from gpusched_cli.exits import EXIT_INTERRUPTED, job_exit_status
from gpusched_cli.parse import parse_dependencies, parse_duration_s, parse_export, parse_size_mib
from gpusched_cli.results import reading
from gpusched_cli.submitspec import check_with_model, might_be_invalid, submitting_environ

# Flag values are converted in callbacks rather than click.ParamType subclasses: ParamType became
# generic in click 8.2+, and callbacks type-check the same on every click we support.


def _size_flag(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    try:
        return None if value is None else parse_size_mib(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


# A limit past a year is a typo (or `99999d` meant as "none", which is leaving --time out). The
# daemon takes any finite limit; this keeps `show` and `queue` from printing nonsense.
MAX_TIME_LIMIT_S = 365 * 86400


def _is_text(value: str) -> bool:
    """Not a byte string in disguise: what Python decodes from non-UTF-8 bytes (argv, environment,
    paths) carries lone surrogates, which JSON, and so the daemon, cannot take."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _working_directory() -> str:
    try:
        cwd = os.getcwd()
    except OSError as exc:  # deleted under the shell, or no longer searchable
        raise click.UsageError(f"the current directory cannot be read ({exc.strerror}); the job runs where you "
                               "submit it: cd to a directory that exists and submit again") from None
    if not _is_text(cwd):
        raise click.UsageError(f"the current directory {cwd!r} is not UTF-8 text, which gpusched cannot pass on; "
                               "submit from a directory whose path is")
    return cwd


def _require_text(command: tuple[str, ...], env: dict[str, str], name: str | None) -> None:
    """Name what is not UTF-8 text, before anything is sent (a clear usage error, not a traceback)."""
    for index, arg in enumerate(command):
        if not _is_text(arg):
            raise click.BadParameter(f"argument {index} ({arg!r}) is not UTF-8 text, which gpusched cannot pass on",
                                     param_hint="'-- CMD'")
    for key, value in env.items():
        if not _is_text(key) or not _is_text(value):
            raise click.BadParameter(
                f"the environment variable {key!r} is not UTF-8 text, which gpusched cannot pass on; unset it, "
                "or name the variables the job needs (--export NAME,NAME=value,...)", param_hint="--export")
    if name is not None and not _is_text(name):
        raise click.BadParameter(f"{name!r} is not UTF-8 text", param_hint="--name")


def _time_flag(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    try:
        seconds = None if value is None else parse_duration_s(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None
    if seconds is not None and seconds > MAX_TIME_LIMIT_S:
        raise click.BadParameter(f"{value!r} is longer than 365 days; leave --time out for no time limit",
                                 ctx, param)
    return seconds


JOB_ID_MAX = 2**63 - 1  # gpusched.model.JobId: SQLite's INTEGER primary key


After = tuple[int, int | None, Literal["ok", "any"]]  # (job or array id, array task or None, condition)


def _after_flag(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> list[After]:
    try:
        deps = [dep for text in value for dep in parse_dependencies(text)]
        too_big = [job_id for job_id, _, _ in deps if job_id > JOB_ID_MAX]
        if too_big:  # no such job can exist
            raise ValueError(f"{too_big[0]} is not a job id: ids go up to {JOB_ID_MAX}")
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None
    return deps


def _task_jobs(client: Client, after: list[After]) -> list[dict[str, Any]]:
    """The dependencies with each array task (`120_7`) replaced by its job's id, asked of the daemon
    (an unknown array or task ends the command as `show 120_7` would)."""
    out = []
    for job_id, task, condition in after:
        if task is not None:
            result = client.request(messages.show(job_id, task))
            with reading("show", result):
                job_id = int(result["job"]["id"])
        out.append(messages.dependency(job_id, condition))
    return out


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
    if fraction < MIN_SHARE:
        raise click.BadParameter(
            f"{value!r} is below {MIN_SHARE:g} (1%): MPS caps a share's SMs in whole percent", ctx, param)
    return fraction


def _array_flag(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """The spec as given (whitespace removed); the daemon checks it again and applies max_array_size."""
    try:
        return None if value is None else parse_array_spec(value).text
    except ArraySpecError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


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
    gpus: int | None, mig: str | None, share: float | None, gpu_mem_mib: int | None, partition: str | None = None,
) -> dict[str, Any]:
    """Exactly one of --gpus / --mig / --share+--gpu-mem (--partition MODE, alone or with --gpus N for
    N logical GPUs of that mode); the error names the flags involved."""
    if partition is not None:
        if mig is not None or share is not None or gpu_mem_mib is not None:
            said = " and ".join(f for f, v in (("--mig", mig), ("--share", share), ("--gpu-mem", gpu_mem_mib))
                                if v is not None)
            raise click.UsageError(f"--partition MODE goes alone or with --gpus N (got it with {said})")
        return messages.partition(partition.upper(), gpus or 1)
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
        return messages.whole(gpus)
    if mig is not None:
        return messages.mig(mig)
    assert share is not None
    if gpu_mem_mib is None:
        raise click.UsageError("--share F needs --gpu-mem SIZE, the GPU memory cap of the share (e.g. 10G)")
    return messages.share(share, gpu_mem_mib)



@click.command(context_settings={"allow_interspersed_args": False})
@click.option("--gpus", type=click.IntRange(1, 64), help="N whole GPUs")
@click.option("--mig", metavar="PROFILE", callback=_check_mig, help="one MIG instance, e.g. 3g.40gb")
@click.option("--partition", type=click.Choice(["spx", "dpx", "qpx", "cpx"], case_sensitive=False),
              help="AMD Instinct: a logical GPU of a physical GPU in this compute partition mode (with --gpus N: N "
                   "of them); idle GPUs change mode from demand")
@click.option("--share", metavar="F", callback=_fraction_flag,
              help="a fraction of one GPU's compute on a shared device (MPS or time-slicing), e.g. 0.25 or 25%, "
                   "at least 0.01; needs --gpu-mem")
@click.option("--gpu-mem", "gpu_mem", metavar="SIZE", callback=_size_flag,
              help="GPU memory cap with --share: 10G, 512M, 1.5GiB, 1024 (MiB)")
@click.option("--name", help="job name (default: the program's name)")
@click.option("--time", "time_limit", metavar="TIME", callback=_time_flag,
              help="time limit: minutes, M:S, H:M:S, D-H:M:S, or 30s / 5m / 2h / 1d; at most 365 days "
                   "(omit it for none)")
@click.option("--class", "job_class", type=click.Choice(["batch", "interactive"]), default="batch",
              show_default=True, help="interactive jobs start sooner, without a bigger share")
@click.option("--nice", type=click.IntRange(0, 19), default=0, show_default=True,
              help="lower the job's priority among your own jobs")
@click.option("--requeue", is_flag=True, help="put the job back in the queue if it is preempted")
@click.option("--after", multiple=True, metavar="ID[:ok|any]", callback=_after_flag,
              help="start only after job ID ended (ok: COMPLETED, the default; any: however); an array's id "
                   "waits for all its tasks, ARRAY_TASK (120_7) for one; repeatable")
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
@click.option("--json", "as_json", is_flag=True, help='print {"job_id": N, "state": S} (an array adds "tasks": N)')
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED, metavar="-- CMD [ARGS]...")
@click.pass_context
def submit(
    ctx: click.Context,
    gpus: int | None,
    mig: str | None,
    partition: str | None,
    share: float | None,
    gpu_mem: int | None,
    name: str | None,
    time_limit: int | None,
    job_class: str,
    nice: int,
    requeue: bool,
    after: list[After],
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
      gpusched submit --partition cpx -- python small.py   # AMD: one eighth of an MI300X
      gpusched submit --gpus 1 --array 0-99%8 -- python sweep.py   # task i reads $GPUSCHED_ARRAY_TASK_ID
    """
    if array is not None and wait:
        raise click.UsageError("--wait waits for one job; with --array, wait with `gpusched queue` or `show ID`")
    if not command[0].strip():  # it would only fail at exec, after waiting its turn for a GPU
        raise click.BadParameter("the program to run is empty", param_hint="'-- CMD'")
    request = build_request(gpus, mig, share, gpu_mem, partition)
    try:
        env = parse_export(export, submitting_environ())
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--export") from None
    cwd = _working_directory()
    _require_text(command, env, name)
    spec = messages.job_spec(
        argv=list(command),
        cwd=cwd,
        env=env,
        request=request,
        name=name,
        time_limit_s=time_limit,
        job_class=job_class,
        nice=nice,
        requeue=requeue,
        precision=precision,
        after=[messages.dependency(job_id, condition) for job_id, _, condition in after],
        cpus=cpus,
        mem_mib=mem,
    )
    if might_be_invalid(spec):
        check_with_model(spec)

    with connected(ctx, retry_broken_s=resubmit.RETRY_FOR_S) as client:
        if any(task is not None for _, task, _ in after):
            spec["after"] = _task_jobs(client, after)
        message = messages.submit(spec, hold, array=array, request_id=resubmit.new_request_id())
        submitted = resubmit.submit(client, message)
        with reading("submit", submitted):
            job_id, state = int(submitted["job_id"]), str(submitted["state"])
            tasks = None if submitted.get("tasks") is None else int(submitted["tasks"])
        try:  # from here on Ctrl-C only stops the waiting: say so, and which job lives on
            if as_json:
                print_json({"job_id": job_id, "state": state} | ({"tasks": tasks} if tasks is not None else {}),
                           compact=True)
            elif tasks is not None:
                echo(f"Submitted array job {job_id} ({tasks} tasks: {job_id}_[{array}])")
            else:
                echo(f"Submitted job {job_id}")
            if not wait:
                return
            job = _wait_for(client, job_id)
        except KeyboardInterrupt:
            echo(
                f"\nStopped waiting; job {job_id} keeps running "
                f"(`gpusched cancel {job_id}` to stop it)",
                err=True,
            )
            sys.exit(EXIT_INTERRUPTED)
    with reading("wait", {"job": job, "finished": True}):
        status = job_exit_status(job)
        if as_json:
            print_json(
                {"job_id": job["id"], "state": job["state"], "exit_code": job.get("exit_code"),
                 "signal": job.get("signal"), "exit_status": status},
                compact=True,
            )
        else:
            echo(render.final_state_text(job), err=True)
    sys.exit(status)


def _wait_for(client: Client, job_id: int) -> dict[str, Any]:
    """Long-poll `wait` until the job is in a final state (a requeued job is waited through)."""
    while True:
        result = client.request(messages.wait(job_id, 30.0))
        with reading("wait", result):
            if result["finished"]:
                job: dict[str, Any] = result["job"]
                return job
