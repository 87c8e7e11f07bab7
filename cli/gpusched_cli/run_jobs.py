"""What the job commands do, without click: queue, show, logs, wait, cancel, suspend, resume, hold,
release, with their options as data (commands/jobs.py makes the click commands from them; fastpath.py
parses them without click).

show, logs, wait and cancel also take an array task as ARRAY_TASK (`123_7`); queue lists an array as
one row; an array's id makes cancel, suspend, resume, hold and release act on all its tasks.
"""

from __future__ import annotations

import sys
import time

from gpusched.arrayspec import parse_job_ref
from gpusched_cli import messages
from gpusched_cli.common import Target, connected, echo, print_json, write_verbatim
from gpusched_cli.exits import EXIT_INTERRUPTED, job_exit_status
from gpusched_cli.options import CHOICE, FLAG, INT, Command, Option, Positional
from gpusched_cli.results import reading

TYPE_CHECKING = False  # typing costs the fast path a few ms to import; mypy reads this as True
if TYPE_CHECKING:
    from typing import Any, NoReturn

    from gpusched_cli.client import Client

JobRef = tuple[int, int | None]  # (job or array id, task index or None)

# The job arguments of show / logs / wait (one) and cancel / suspend / resume / hold / release (many):
# a job id (an array's id: all its tasks), or an array task as `123_7` (parse_job_ref's ArraySpecError
# is a ValueError: click names the argument).
REF = Positional("ref", "one", parse_job_ref, metavar="ID|ARRAY_TASK")
REFS = Positional("refs", "many", parse_job_ref, metavar="ID|ARRAY_TASK...")

QUEUE = Command([
    Option("--all", dest="show_all", kind=FLAG,
           help="include finished jobs (those the daemon still keeps: see finished_job_retention_s)"),
    Option("--user", dest="user", metavar="USER", help="only this user's jobs"),
    Option("--order", dest="order", kind=CHOICE, choices=("id", "fairness"), default="id", show_default=True,
           help="fairness: pending jobs in the order the scheduler would start them"),
    Option("--limit", dest="limit", kind=INT, low=1, high=3000, default=1000, show_default=True,
           help="at most this many rows"),
    Option("--array-tasks", dest="array_tasks", kind=FLAG,
           help="one row per array task (ARRAY_TASK) instead of one row per array"),
    Option("--json", dest="as_json", kind=FLAG, help='print {"jobs": [...], "total": N, "arrays": [...]} '
           "(see docs/cli.md)"),
])
SHOW = Command([Option("--json", dest="as_json", kind=FLAG, help="print the daemon's ShowResult (see docs/cli.md)")],
               REF)
LOGS = Command([Option("-f", "--follow", dest="follow", kind=FLAG, help="keep printing new output until the job ends")],
               REF)
WAIT = Command([Option("--json", dest="as_json", kind=FLAG,
                       help='print {"job_id", "state", "exit_code", "signal", "exit_status"} when it ends')], REF)
REFS_ONLY = Command([], REFS)  # cancel, suspend, resume, hold, release


def queue(target: Target, *, show_all: bool, user: str | None, order: str, limit: int, array_tasks: bool,
          as_json: bool) -> None:
    labels: dict[str, str] = {}
    with connected(target) as client:
        result = client.request(messages.queue(all_jobs=show_all, user=user, order=order, limit=limit,
                                               array_tasks=array_tasks))
        with reading("queue", result):
            placed = not as_json and any(job["devices"] for job in result["jobs"])
        if placed:
            from gpusched_cli.render import device_labels

            gpus = client.request(messages.bare("gpus"))
            with reading("gpus", gpus):
                labels = device_labels(gpus)
    if as_json:
        print_json(result)
        return
    from gpusched_cli.render import queue_table

    with reading("queue", result):
        text = queue_table(result["jobs"], time.time(), labels, result.get("arrays", []),
                           keep_order=order == "fairness")
        hidden = result.get("total", 0) - len(result["jobs"])
        arrays_total = result.get("arrays_total")
        if arrays_total is not None:  # array rows left out too (they count against --limit after the jobs)
            hidden += arrays_total - len(result.get("arrays", []))
    echo(text)
    if hidden > 0:
        echo(f"... {hidden} more not shown (narrow with --user, or --limit up to 3000)")


def show(target: Target, *, ref: JobRef, as_json: bool) -> None:
    with connected(target) as client:
        result = client.request(messages.show(*ref))
    if as_json:
        print_json(result)
        return
    from gpusched_cli.render import show_text

    with reading("show", result):
        text = show_text(result, time.time())
    echo(text)


def logs(target: Target, *, ref: JobRef, follow: bool) -> None:
    job_id, task = ref
    offset = 0
    try:
        with connected(target) as client:
            while True:
                chunk = client.request(messages.logs(job_id, offset, 10.0 if follow else 0.0, task=task))
                with reading("logs", chunk):
                    data, next_offset, eof = str(chunk["data"]), int(chunk["next_offset"]), bool(chunk["eof"])
                if data:
                    write_verbatim(data)
                advanced = next_offset != offset
                offset = next_offset
                if eof or (not follow and not advanced):
                    return
    except KeyboardInterrupt:
        sys.exit(EXIT_INTERRUPTED)


def wait(target: Target, *, ref: JobRef, as_json: bool) -> None:
    job_id, task = ref
    with connected(target) as client:
        try:
            job = wait_for(client, job_id, task)
        except KeyboardInterrupt:
            name = str(job_id) if task is None else f"{job_id}_{task}"
            echo(f"\nStopped waiting; job {name} keeps going (`gpusched cancel {name}` to stop it)", err=True)
            sys.exit(EXIT_INTERRUPTED)
    exit_as_it_ended(job, as_json)


def wait_for(client: Client, job_id: int, task: int | None = None) -> dict[str, Any]:
    """Long-poll `wait` until the job is in a final state (a requeued job is waited through); its JSON."""
    while True:
        result = client.request(messages.wait(job_id, 30.0, task=task))
        with reading("wait", result):
            finished, job = bool(result["finished"]), result["job"]
        if finished:
            ended: dict[str, Any] = job
            return ended


def exit_as_it_ended(job: dict[str, Any], as_json: bool) -> NoReturn:
    """How a job waited for ended (`wait`, `submit --wait`): with `as_json` the documented object on
    stdout, else its final state on stderr; then exit with its exit status."""
    with reading("wait", {"job": job, "finished": True}):
        status = job_exit_status(job)
        if as_json:
            print_json({"job_id": job["id"], "state": job["state"], "exit_code": job.get("exit_code"),
                        "signal": job.get("signal"), "exit_status": status}, compact=True)
        else:
            from gpusched_cli.render import final_state_text  # only a wait prints a job's ending

            echo(final_state_text(job), err=True)
    sys.exit(status)


def cancel(target: Target, *, refs: list[JobRef]) -> None:
    request = messages.cancel([i for i, t in refs if t is None],
                              [messages.task_ref(i, t) for i, t in refs if t is not None])
    with connected(target) as client:
        result = client.request(request)
    from gpusched_cli.render import cancel_text

    with reading("cancel", result):
        text = cancel_text(result)
    echo(text)


# suspend, resume, hold, release: the op and what the reply's first line says was done
JOB_CONTROL = {"suspend": "Suspended", "resume": "Resumed", "hold": "Held", "release": "Released"}


def job_control(target: Target, op: str, *, refs: list[JobRef]) -> None:
    request = messages.job_control(op, [i for i, t in refs if t is None],
                                   [messages.task_ref(i, t) for i, t in refs if t is not None])
    with connected(target) as client:
        result = client.request(request)
    from gpusched_cli.render import changed_text

    with reading(op, result):
        text = changed_text(JOB_CONTROL[op], result)
    echo(text)
