"""The `gpusched` program: the everyday commands without click, everything else through click.

Importing click costs more than the interpreter's own start, and `gpusched submit` in a loop is how
scripts use the client (issue 13). So the console script enters here: when the command line is a
plain one for a job command (`[--socket PATH] submit|queue|show|logs|wait|cancel|suspend|resume|hold|
release ...`), its options are parsed from the same declarations click builds its own from
(options.py) and the command's shared code runs (run_submit.py, run_jobs.py). For anything else
(help, `--version`, another command, a value the strict parser leaves to click, a usage problem
found before anything is sent, shell completion) `run` answers None before any side effect and the
click program runs instead, from the start, so its messages and exit codes are the only ones.

Where a C compiler was found at install, the installed `gpusched` is the C front (front.c), which
sends a plain submit without starting Python at all, and runs `main` here for every other command
line, or `resume` for a submit it sent but could not finish.
"""

from __future__ import annotations

import os
import sys

from gpusched_cli import run_jobs
from gpusched_cli.common import Target, report_failure
from gpusched_cli.options import UsageProblem

TYPE_CHECKING = False  # typing costs the fast path a few ms to import; mypy reads this as True
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import Any

    from gpusched_cli.options import Command

    # A fast command's plan: (target, parsed values) -> the work to run; making it may raise UsageProblem.
    Plan = Callable[[Target, dict[str, Any]], Callable[[], None]]

EXIT_ABORTED = 1  # what click exits with after Ctrl-C outside a command's own handling ("Aborted!")
COMPLETE_VAR = "_GPUSCHED_COMPLETE"  # click's shell completion asks through this variable


def _submit(target: Target, values: dict[str, Any]) -> Callable[[], None]:
    from gpusched_cli import run_submit

    job = run_submit.prepare(**values)  # UsageProblem: click says it
    return lambda: run_submit.send(target, job)


def _job(action: Callable[..., None]) -> Plan:
    return lambda target, values: lambda: action(target, **values)


def _control(op: str) -> Plan:
    return lambda target, values: lambda: run_jobs.job_control(target, op, **values)


# The fast job commands: each one's declaration and plan (submit's are imported only when it runs).
JOBS: dict[str, tuple[Command, Plan]] = {
    "queue": (run_jobs.QUEUE, _job(run_jobs.queue)), "show": (run_jobs.SHOW, _job(run_jobs.show)),
    "logs": (run_jobs.LOGS, _job(run_jobs.logs)), "wait": (run_jobs.WAIT, _job(run_jobs.wait)),
    "cancel": (run_jobs.REFS_ONLY, _job(run_jobs.cancel)),
    **{op: (run_jobs.REFS_ONLY, _control(op)) for op in run_jobs.JOB_CONTROL},
}


def _fast(name: str) -> tuple[Command, Plan] | None:
    if name == "submit":
        from gpusched_cli.run_submit import SUBMIT

        return SUBMIT, _submit
    return JOBS.get(name)


def parse(argv: Sequence[str]) -> tuple[str | None, str, dict[str, Any]] | None:
    """(--socket, command, its values) for a plain command line of a fast command, else None."""
    socket: str | None = None
    i = 0
    while i < len(argv) and argv[i].startswith("--socket"):
        name, eq, value = argv[i].partition("=")
        if name != "--socket" or socket is not None:
            return None
        if not eq:
            if i + 1 >= len(argv) or argv[i + 1][:1] == "-":
                return None
            i += 1
            value = argv[i]
        socket = value
        i += 1
    if i >= len(argv):
        return None
    fast = _fast(argv[i])
    values = None if fast is None else fast[0].parse(argv[i + 1:])
    return None if values is None else (socket, argv[i], values)


def run(argv: Sequence[str]) -> int | None:
    """Run a plain job command and return its exit status; None (having done nothing) for click."""
    if COMPLETE_VAR in os.environ:
        return None
    parsed = parse(argv)
    if parsed is None:
        return None
    socket, name, values = parsed
    target = Target(socket)
    try:
        plan = _fast(name)
        assert plan is not None  # parse() answered for this name
        work = plan[1](target, values)
    except UsageProblem:
        return None
    return _perform(work, target)


def _perform(work: Callable[[], None], target: Target) -> int:
    """Run a command's work as click would: its failures as exit codes and `error:` lines."""
    try:
        work()
    except KeyboardInterrupt:  # as click: a blank line and "Aborted!"
        sys.stderr.write("\nAborted!\n")
        return EXIT_ABORTED
    except Exception as exc:
        report_failure(exc, target)
        raise
    return 0


def resume() -> None:
    """Where the C front (front.c) hands over a submit it sent without getting the plain answer back
    (an error, a lost connection, a reply it does not read): `-c CODE SOCKET FD JSON`, the request it
    sent in the memfd FD. Sent again with the same request_id, as `send` does after a lost connection,
    so a job the daemon queued the first time is answered, not queued twice; then reported as here."""
    import json

    from gpusched_cli import run_submit

    path, fd, as_json = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    with os.fdopen(fd, "rb") as sent:
        message = json.loads(sent.read())
    job = run_submit.Prepared(message["spec"], [], bool(message["hold"]), None, False, as_json)
    target = Target(path)
    sys.exit(_perform(lambda: run_submit.send(target, job, request_id=message["request_id"]), target))


def main() -> None:
    """The console script `gpusched`."""
    status = run(sys.argv[1:])
    if status is None:
        from gpusched_cli.main import cli

        cli(prog_name="gpusched")
    sys.exit(status)
