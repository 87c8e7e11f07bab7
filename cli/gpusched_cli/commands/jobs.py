"""Looking at jobs and acting on them: queue, show, logs, wait, cancel, suspend, resume, hold, release.

show, logs, wait and cancel also take an array task as ARRAY_TASK (`123_7`); queue lists an array as
one row; an array's id makes cancel, suspend, resume, hold and release act on all its tasks.
"""

from __future__ import annotations

import sys
import time

import click

from gpusched_cli import messages, render
from gpusched_cli.common import REF, REFS, JobRef, connected, echo, print_json, write_verbatim
from gpusched_cli.exits import EXIT_INTERRUPTED, job_exit_status
from gpusched_cli.results import reading


@click.command()
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
    with connected(ctx) as client:
        result = client.request(messages.queue(all_jobs=show_all, user=user, order=order, limit=limit,
                                               array_tasks=array_tasks))
        with reading("queue", result):
            placed = not as_json and any(job["devices"] for job in result["jobs"])
        if placed:
            gpus = client.request(messages.bare("gpus"))
            with reading("gpus", gpus):
                labels = render.device_labels(gpus)
    if as_json:
        print_json(result)
        return
    with reading("queue", result):
        text = render.queue_table(result["jobs"], time.time(), labels, result.get("arrays", []),
                                  keep_order=order == "fairness")
        hidden = result.get("total", 0) - len(result["jobs"])
        arrays_total = result.get("arrays_total")
        if arrays_total is not None:  # array rows left out too (they count against --limit after the jobs)
            hidden += arrays_total - len(result.get("arrays", []))
    echo(text)
    if hidden > 0:
        echo(f"... {hidden} more not shown (narrow with --user, or --limit up to 3000)")


@click.command()
@REF
@click.option("--json", "as_json", is_flag=True, help="print the daemon's ShowResult (see docs/cli.md)")
@click.pass_context
def show(ctx: click.Context, ref: JobRef, as_json: bool) -> None:
    """Everything about one job (or array task, 123_7): spec, state history, allocation, exit status, log path.
    An array's id shows the array's counts and its first unfinished task."""
    with connected(ctx) as client:
        result = client.request(messages.show(*ref))
    if as_json:
        print_json(result)
        return
    with reading("show", result):
        text = render.show_text(result, time.time())
    echo(text)


@click.command()
@REF
@click.option("-f", "--follow", is_flag=True, help="keep printing new output until the job ends")
@click.pass_context
def logs(ctx: click.Context, ref: JobRef, follow: bool) -> None:
    """Print a job's (or array task's, 123_7) combined stdout and stderr, verbatim."""
    job_id, task = ref
    offset = 0
    try:
        with connected(ctx) as client:
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


@click.command()
@REFS
@click.pass_context
def cancel(ctx: click.Context, refs: list[JobRef]) -> None:
    """Cancel jobs: pending ones leave the queue, running ones are stopped. An array's id cancels
    all its tasks; ARRAY_TASK (123_7) one of them."""
    request = messages.cancel([i for i, t in refs if t is None],
                              [messages.task_ref(i, t) for i, t in refs if t is not None])
    with connected(ctx) as client:
        result = client.request(request)
    with reading("cancel", result):
        text = render.cancel_text(result)
    echo(text)


@click.command()
@REF
@click.option("--json", "as_json", is_flag=True,
              help='print {"job_id", "state", "exit_code", "signal", "exit_status"} when it ends')
@click.pass_context
def wait(ctx: click.Context, ref: JobRef, as_json: bool) -> None:
    """Block until a job (or array task, 123_7) ends; exit with its exit status, as `submit --wait`.

    A requeued job is waited through. Ctrl-C stops the waiting, not the job."""
    job_id, task = ref
    with connected(ctx) as client:
        try:
            while True:
                result = client.request(messages.wait(job_id, 30.0, task=task))
                with reading("wait", result):
                    finished, job = bool(result["finished"]), result["job"]
                if finished:
                    break
        except KeyboardInterrupt:
            name = str(job_id) if task is None else f"{job_id}_{task}"
            echo(f"\nStopped waiting; job {name} keeps going (`gpusched cancel {name}` to stop it)", err=True)
            sys.exit(EXIT_INTERRUPTED)
    with reading("wait", result):
        status = job_exit_status(job)
        if as_json:
            print_json({"job_id": job["id"], "state": job["state"], "exit_code": job.get("exit_code"),
                        "signal": job.get("signal"), "exit_status": status}, compact=True)
        else:
            echo(render.final_state_text(job), err=True)
    sys.exit(status)


def _job_control(ctx: click.Context, op: str, refs: list[JobRef], done: str) -> None:
    request = messages.job_control(op, [i for i, t in refs if t is None],
                                   [messages.task_ref(i, t) for i, t in refs if t is not None])
    with connected(ctx) as client:
        result = client.request(request)
    with reading(op, result):
        text = render.changed_text(done, result)
    echo(text)


@click.command()
@REFS
@click.pass_context
def suspend(ctx: click.Context, refs: list[JobRef]) -> None:
    """Pause running jobs (SIGSTOP); they keep their devices and GPU memory. An array's id pauses
    all its running tasks; ARRAY_TASK (123_7) one of them."""
    _job_control(ctx, "suspend", refs, "Suspended")


@click.command()
@REFS
@click.pass_context
def resume(ctx: click.Context, refs: list[JobRef]) -> None:
    """Continue suspended jobs (SIGCONT). An array's id continues all its suspended tasks;
    ARRAY_TASK (123_7) one of them."""
    _job_control(ctx, "resume", refs, "Resumed")


@click.command()
@REFS
@click.pass_context
def hold(ctx: click.Context, refs: list[JobRef]) -> None:
    """Keep pending jobs from starting until they are released. An array's id holds all its
    pending tasks; ARRAY_TASK (123_7) one of them."""
    _job_control(ctx, "hold", refs, "Held")


@click.command()
@REFS
@click.pass_context
def release(ctx: click.Context, refs: list[JobRef]) -> None:
    """Let held jobs start again. An array's id releases all its held tasks; ARRAY_TASK (123_7)
    one of them."""
    _job_control(ctx, "release", refs, "Released")
