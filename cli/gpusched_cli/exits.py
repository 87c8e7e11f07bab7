"""The CLI's exit codes, one per kind of failure, so scripts can branch on them (docs/cli.md)."""

from __future__ import annotations

from gpusched.wire import ErrorCode
from gpusched_cli.results import CANCELLED, COMPLETED, FAILED, LOST, TIMEOUT, plain

TYPE_CHECKING = False  # typing costs the fast path a few ms to import; mypy reads this as True
if TYPE_CHECKING:
    from gpusched.model import Job
    from gpusched_cli.results import JSON

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
EXIT_OUTPUT_CLOSED = 141  # stdout's reader went away (128 + SIGPIPE, what a shell shows for a C tool)

CODE_EXITS: dict[ErrorCode, int] = {
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
  141  the reader of the output went away (a pipe closed), quietly
\b
submit --wait and wait exit with the job's own exit code, or:
  128+N  the job was killed by signal N
  122    the job was cancelled
  123    the job was lost (its process vanished, e.g. daemon host crash)
  124    the job hit its time limit
  125    the job failed before its program ran (no exit status)
  130    interrupted (Ctrl-C) while waiting; the job keeps running
\b
Socket: --socket PATH, else $GPUSCHED_SOCKET, else the first of
/run/gpusched/gpusched.sock, $XDG_RUNTIME_DIR/gpusched/gpusched.sock,
/tmp/gpusched-$UID/gpusched.sock that accepts connections. See docs/cli.md."""


def job_exit_status(job: Job | JSON) -> int:
    """The exit status `submit --wait` gives for a finished job (see EXIT_CODES_HELP)."""
    shown = plain(job)
    state, exit_code, signal = shown["state"], shown.get("exit_code"), shown.get("signal")
    if state == TIMEOUT:
        return EXIT_JOB_TIMEOUT
    if state == CANCELLED:
        return EXIT_JOB_CANCELLED
    if state == LOST:
        return EXIT_JOB_LOST
    if signal is not None:
        return 128 + int(signal)
    if state == FAILED and exit_code == 0:
        # FAILED although its program exited 0: the daemon stopped it with SIGTERM (its GPU failed,
        # or it went over --gpu-mem) and the program saved its work and exited cleanly. Never 0,
        # so `submit --wait ... && next` does not go on; 143 as if SIGTERM had ended it.
        from signal import SIGTERM  # here: `signal` builds enum classes at import, which other commands skip

        return 128 + SIGTERM
    if exit_code is not None:
        return int(exit_code) & 0xFF if exit_code >= 0 else EXIT_JOB_NOT_RUN
    return EXIT_OK if state == COMPLETED else EXIT_JOB_NOT_RUN
