"""What `gpusched submit` does, without click: its options as data, flags -> a JobSpec as plain
JSON -> one `submit` request (and `--wait`).

commands/submit.py makes the click command from SUBMIT; fastpath.py parses the same declaration
when the command line is a plain one and calls `prepare` and `send` itself, never importing click.
The request carries a request_id of its own and is sent again across a daemon restart (resubmit.py);
`--array` makes it a job array, checked here with the daemon's own parser before anything is sent.

The spec is built as the JSON the JobSpec model would dump (gpusched_cli.messages), without
pydantic: the model is consulted only for a spec that might break one of its limits, so its message
still names the field (exit 2) and the common case stays fast.
"""

from __future__ import annotations

import os
import re
import sys

from gpusched.arrayspec import parse_array_spec
from gpusched.wire import MIN_SHARE
from gpusched_cli import messages, resubmit
from gpusched_cli.common import Target, connected, echo, print_json
from gpusched_cli.exits import EXIT_INTERRUPTED
from gpusched_cli.options import CHOICE, FLAG, INT, Command, Option, Positional, UsageProblem
from gpusched_cli.parse import parse_dependencies, parse_duration_s, parse_size_mib
from gpusched_cli.results import reading
from gpusched_cli.run_jobs import exit_as_it_ended, wait_for

TYPE_CHECKING = False  # typing costs the fast path a few ms to import; mypy reads this as True
if TYPE_CHECKING:
    from typing import Any, Literal

    from gpusched_cli.client import Client

    After = tuple[int, int | None, Literal["ok", "any"]]  # (job or array id, array task or None, condition)

# A limit past a year is a typo (or `99999d` meant as "none", which is leaving --time out). The
# daemon takes any finite limit; this keeps `show` and `queue` from printing nonsense.
MAX_TIME_LIMIT_S = 365 * 86400
JOB_ID_MAX = 2**63 - 1  # gpusched.model.JobId: SQLite's INTEGER primary key
_MIG_PROFILE = r"^[0-9]+g\.[0-9]+gb(\+me)?$"  # compiled on first use (re's cache)


# Flag values: each converter raises ValueError with what click shows after "Invalid value for '--flag':".

def time_limit(value: str) -> int:
    seconds = parse_duration_s(value)
    if seconds > MAX_TIME_LIMIT_S:
        raise ValueError(f"{value!r} is longer than 365 days; leave --time out for no time limit")
    return seconds


def dependencies(values: tuple[str, ...]) -> list[After]:
    deps = [dep for text in values for dep in parse_dependencies(text)]
    too_big = [job_id for job_id, _, _ in deps if job_id > JOB_ID_MAX]
    if too_big:  # no such job can exist
        raise ValueError(f"{too_big[0]} is not a job id: ids go up to {JOB_ID_MAX}")
    return deps


def fraction(value: str) -> float:
    text = value.strip()
    try:
        share = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise ValueError(f"{value!r} is not a fraction; use a number in (0, 1] such as 0.25, or a percentage: 25%"
                         ) from None
    if not 0.0 < share <= 1.0:
        raise ValueError(f"{value!r} must be more than 0 and at most 1 (a fraction of one GPU's compute)")
    if share < MIN_SHARE:
        raise ValueError(f"{value!r} is below {MIN_SHARE:g} (1%): MPS caps a share's SMs in whole percent")
    return share


def array_spec(value: str) -> str:
    """The spec as given (whitespace removed); the daemon checks it again and applies max_array_size."""
    return parse_array_spec(value).text  # ArraySpecError is a ValueError


def mig_profile(value: str) -> str:
    if not re.match(_MIG_PROFILE, value):
        raise ValueError(f"{value!r} is not a MIG profile; profiles look like 1g.10gb, 3g.40gb, 7g.80gb "
                         "(`gpusched gpus` shows the ones in use)")
    return value


SUBMIT = Command([
    Option("--gpus", dest="gpus", kind=INT, low=1, high=64, help="N whole GPUs"),
    Option("--mig", dest="mig", convert=mig_profile, metavar="PROFILE", help="one MIG instance, e.g. 3g.40gb"),
    Option("--partition", dest="partition", kind=CHOICE, choices=("spx", "dpx", "qpx", "cpx"), case_sensitive=False,
           help="AMD Instinct: a logical GPU of a physical GPU in this compute partition mode (with --gpus N: N "
                "of them); idle GPUs change mode from demand"),
    Option("--share", dest="share", convert=fraction, metavar="F",
           help="a fraction of one GPU's compute on a shared device (MPS or time-slicing), e.g. 0.25 or 25%, "
                "at least 0.01; needs --gpu-mem"),
    Option("--gpu-mem", dest="gpu_mem", convert=parse_size_mib, metavar="SIZE",
           help="GPU memory cap with --share: 10G, 512M, 1.5GiB, 1024 (MiB)"),
    Option("--name", dest="name", help="job name (default: the program's name)"),
    Option("--time", dest="time_limit", convert=time_limit, metavar="TIME",
           help="time limit: minutes, M:S, H:M:S, D-H:M:S, or 30s / 5m / 2h / 1d; at most 365 days "
                "(omit it for none)"),
    Option("--class", dest="job_class", kind=CHOICE, choices=("batch", "interactive"), default="batch",
           show_default=True, help="interactive jobs start sooner, without a bigger share"),
    Option("--nice", dest="nice", kind=INT, low=0, high=19, default=0, show_default=True,
           help="lower the job's priority among your own jobs"),
    Option("--requeue", dest="requeue", kind=FLAG, help="put the job back in the queue if it is preempted"),
    Option("--after", dest="after", multiple=True, convert=dependencies, metavar="ID[:ok|any]",
           help="start only after job ID ended (ok: COMPLETED, the default; any: however); an array's id "
                "waits for all its tasks, ARRAY_TASK (120_7) for one; repeatable"),
    Option("--cpus", dest="cpus", kind=INT, low=1, high=4096, help="host CPU cores for the job"),
    Option("--mem", dest="mem", convert=parse_size_mib, metavar="SIZE", help="host memory limit: 32G, 512M, ..."),
    Option("--hold", dest="hold", kind=FLAG, help="submit held: the job starts only after `gpusched release`"),
    Option("--array", dest="array", convert=array_spec, metavar="A-B[:STEP][,...][%MAX]",
           help="a job array as sbatch: one task per index (GPUSCHED_ARRAY_TASK_ID), at most MAX running at once"),
    Option("--export", dest="export", default="ALL", show_default=True, metavar="ALL|NONE|VAR[=VAL],...",
           help="the job's environment, as sbatch: all of yours, none, or only the listed variables"),
    Option("--precision", dest="precision", kind=CHOICE, choices=("fp16", "bf16", "fp32", "tf32"),
           help="prefer GPUs that are fast at this precision"),
    Option("--wait", dest="wait", kind=FLAG, help="block until the job ends and exit with its exit code"),
    Option("--json", dest="as_json", kind=FLAG,
           help='print {"job_id": N, "state": S} (an array adds "tasks": N)'),
], Positional("command", "rest", metavar="-- CMD [ARGS]..."), interspersed=False)


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
        raise UsageProblem(f"the current directory cannot be read ({exc.strerror}); the job runs where you "
                           "submit it: cd to a directory that exists and submit again") from None
    if not _is_text(cwd):
        raise UsageProblem(f"the current directory {cwd!r} is not UTF-8 text, which gpusched cannot pass on; "
                           "submit from a directory whose path is")
    return cwd


def _require_text(command: tuple[str, ...], env: dict[str, str], name: str | None) -> None:
    """Name what is not UTF-8 text, before anything is sent (a clear usage error, not a traceback)."""
    for index, arg in enumerate(command):
        if not _is_text(arg):
            raise UsageProblem(f"argument {index} ({arg!r}) is not UTF-8 text, which gpusched cannot pass on",
                               "'-- CMD'")
    for key, value in env.items():
        if not _is_text(key) or not _is_text(value):
            raise UsageProblem(
                f"the environment variable {key!r} is not UTF-8 text, which gpusched cannot pass on; unset it, "
                "or name the variables the job needs (--export NAME,NAME=value,...)", "--export")
    if name is not None and not _is_text(name):
        raise UsageProblem(f"{name!r} is not UTF-8 text", "--name")


def build_request(
    gpus: int | None, mig: str | None, share: float | None, gpu_mem_mib: int | None, partition: str | None = None,
) -> dict[str, Any]:
    """Exactly one of --gpus / --mig / --share+--gpu-mem (--partition MODE, alone or with --gpus N for
    N logical GPUs of that mode); the error names the flags involved."""
    if partition is not None:
        if mig is not None or share is not None or gpu_mem_mib is not None:
            said = " and ".join(f for f, v in (("--mig", mig), ("--share", share), ("--gpu-mem", gpu_mem_mib))
                                if v is not None)
            raise UsageProblem(f"--partition MODE goes alone or with --gpus N (got it with {said})")
        return messages.partition(partition.upper(), gpus or 1)
    chosen = [flag for flag, v in (("--gpus", gpus), ("--mig", mig), ("--share", share)) if v is not None]
    if len(chosen) != 1:
        said = f"got {' and '.join(chosen)}" if chosen else "got none"
        raise UsageProblem(f"choose exactly one of --gpus N, --mig PROFILE or --share F --gpu-mem SIZE ({said})")
    if gpu_mem_mib is not None and share is None:
        raise UsageProblem("--gpu-mem SIZE goes with --share F (whole GPUs and MIG instances bring their own memory)")
    if gpus is not None:
        return messages.whole(gpus)
    if mig is not None:
        return messages.mig(mig)
    assert share is not None
    if gpu_mem_mib is None:
        raise UsageProblem("--share F needs --gpu-mem SIZE, the GPU memory cap of the share (e.g. 10G)")
    return messages.share(share, gpu_mem_mib)


class Prepared:
    """A submit checked and built, ready to send: nothing about it can be a usage error any more."""

    __slots__ = ("after", "array", "as_json", "hold", "spec", "wait")

    def __init__(self, spec: dict[str, Any], after: list[After], hold: bool, array: str | None, wait: bool,
                 as_json: bool) -> None:
        self.spec, self.after, self.hold, self.array, self.wait, self.as_json = spec, after, hold, array, wait, as_json


def prepare(*, gpus: int | None, mig: str | None, partition: str | None, share: float | None, gpu_mem: int | None,
            name: str | None, time_limit: int | None, job_class: str, nice: int, requeue: bool, after: list[After],
            cpus: int | None, mem: int | None, hold: bool, array: str | None, export: str, precision: str | None,
            wait: bool, as_json: bool, command: tuple[str, ...]) -> Prepared:
    """The request for these option values (SUBMIT's), or UsageProblem naming what is wrong. Reads
    the environment and the working directory; sends nothing."""
    from gpusched_cli.parse import parse_export
    from gpusched_cli.submitspec import check_with_model, might_be_invalid, submitting_environ

    if array is not None and wait:
        raise UsageProblem("--wait waits for one job; with --array, wait with `gpusched queue` or `show ID`")
    if not command[0].strip():  # it would only fail at exec, after waiting its turn for a GPU
        raise UsageProblem("the program to run is empty", "'-- CMD'")
    request = build_request(gpus, mig, share, gpu_mem, partition)
    try:
        env = parse_export(export, submitting_environ())
    except ValueError as exc:
        raise UsageProblem(str(exc), "--export") from None
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
    return Prepared(spec, after, hold, array, wait, as_json)


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


def send(target: Target, job: Prepared, request_id: str | None = None) -> None:
    """Submit `job`, print what was queued, and with --wait block until it ends and exit with its status.
    `request_id`: one this request was already sent with, or was about to be when the connection
    broke (by the C front, fastpath.resume)."""
    with connected(target, retry_broken_s=resubmit.RETRY_FOR_S, resumed=request_id is not None) as client:
        if any(task is not None for _, task, _ in job.after):
            job.spec["after"] = _task_jobs(client, job.after)
        message = messages.submit(job.spec, job.hold, array=job.array,
                                  request_id=request_id or resubmit.new_request_id())
        submitted = resubmit.submit(client, message)
        with reading("submit", submitted):
            job_id, state = int(submitted["job_id"]), str(submitted["state"])
            tasks = None if submitted.get("tasks") is None else int(submitted["tasks"])
        try:  # from here on Ctrl-C only stops the waiting: say so, and which job lives on
            if job.as_json:
                print_json({"job_id": job_id, "state": state} | ({"tasks": tasks} if tasks is not None else {}),
                           compact=True)
            elif tasks is not None:
                echo(f"Submitted array job {job_id} ({tasks} tasks: {job_id}_[{job.array}])")
            else:
                echo(f"Submitted job {job_id}")
            if not job.wait:
                return
            finished = wait_for(client, job_id)
        except KeyboardInterrupt:
            echo(f"\nStopped waiting; job {job_id} keeps running (`gpusched cancel {job_id}` to stop it)", err=True)
            sys.exit(EXIT_INTERRUPTED)
    exit_as_it_ended(finished, job.as_json)
