"""The job commands as click commands: queue, show, logs, wait, cancel, suspend, resume, hold,
release. Their options and their work are in run_jobs.py, shared with the fast path."""

from __future__ import annotations

from typing import Any

import click

from gpusched_cli import run_jobs
from gpusched_cli.commands.declared import declared
from gpusched_cli.common import target_of


@click.command()
@declared(run_jobs.QUEUE)
@click.pass_context
def queue(ctx: click.Context, /, **values: Any) -> None:
    """List pending and running jobs (with --all, finished ones too); an array is one row."""
    run_jobs.queue(target_of(ctx), **values)


@click.command()
@declared(run_jobs.SHOW)
@click.pass_context
def show(ctx: click.Context, /, **values: Any) -> None:
    """Everything about one job (or array task, 123_7): spec, state history, allocation, exit status, log path.
    An array's id shows the array's counts and its first unfinished task."""
    run_jobs.show(target_of(ctx), **values)


@click.command()
@declared(run_jobs.LOGS)
@click.pass_context
def logs(ctx: click.Context, /, **values: Any) -> None:
    """Print a job's (or array task's, 123_7) combined stdout and stderr, verbatim."""
    run_jobs.logs(target_of(ctx), **values)


@click.command()
@declared(run_jobs.REFS_ONLY)
@click.pass_context
def cancel(ctx: click.Context, /, **values: Any) -> None:
    """Cancel jobs: pending ones leave the queue, running ones are stopped. An array's id cancels
    all its tasks; ARRAY_TASK (123_7) one of them."""
    run_jobs.cancel(target_of(ctx), **values)


@click.command()
@declared(run_jobs.WAIT)
@click.pass_context
def wait(ctx: click.Context, /, **values: Any) -> None:
    """Block until a job (or array task, 123_7) ends; exit with its exit status, as `submit --wait`.

    A requeued job is waited through. Ctrl-C stops the waiting, not the job."""
    run_jobs.wait(target_of(ctx), **values)


@click.command()
@declared(run_jobs.REFS_ONLY)
@click.pass_context
def suspend(ctx: click.Context, /, **values: Any) -> None:
    """Pause running jobs (SIGSTOP); they keep their devices and GPU memory. An array's id pauses
    all its running tasks; ARRAY_TASK (123_7) one of them."""
    run_jobs.job_control(target_of(ctx), "suspend", **values)


@click.command()
@declared(run_jobs.REFS_ONLY)
@click.pass_context
def resume(ctx: click.Context, /, **values: Any) -> None:
    """Continue suspended jobs (SIGCONT). An array's id continues all its suspended tasks;
    ARRAY_TASK (123_7) one of them."""
    run_jobs.job_control(target_of(ctx), "resume", **values)


@click.command()
@declared(run_jobs.REFS_ONLY)
@click.pass_context
def hold(ctx: click.Context, /, **values: Any) -> None:
    """Keep pending jobs from starting until they are released. An array's id holds all its
    pending tasks; ARRAY_TASK (123_7) one of them."""
    run_jobs.job_control(target_of(ctx), "hold", **values)


@click.command()
@declared(run_jobs.REFS_ONLY)
@click.pass_context
def release(ctx: click.Context, /, **values: Any) -> None:
    """Let held jobs start again. An array's id releases all its held tasks; ARRAY_TASK (123_7)
    one of them."""
    run_jobs.job_control(target_of(ctx), "release", **values)
