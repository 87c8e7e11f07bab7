"""The restart rules: what a job's persisted state plus what its shim left behind mean.

Every combination of job state x shim record (shim.json, status.json: absent / torn / ok) x process
(alive / dead / zombie / pid reused, as `Executor.inspect` reads them) has a rule here, and no rule
raises: a state that cannot be explained ends LOST with a reason (after the daemon kills whatever is
still running), so a restarted daemon always serves. The same rules run on each tick for jobs the
daemon did not start itself (re-adopted after a restart), so a job that ends while the daemon is
down and one that ends later are judged alike.

Pure: `decide` reads a job, its pending stop request and a `Trace`; the engine carries the verdict
out. tests/daemon/test_recovery.py walks the whole matrix with real files and real processes.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from enum import Enum

from gpusched.daemon.executor import NEVER_LAUNCHED, ExitStatus, Record, Trace
from gpusched.model import TERMINAL_STATES, TRANSITIONS, JobState


@dataclass(frozen=True, slots=True)
class StopRequest:
    """Why a running job is being stopped, and the state it ends in once it has exited."""

    final: JobState
    reason: str


class Verdict(Enum):
    KEEP = "keep"  # nothing to do (waiting or ended jobs; a launch still in progress)
    ADOPT = "adopt"  # still running: watch it (STARTING becomes RUNNING), re-issue any stop request
    FINISH = "finish"  # it ended and said how: record that
    REQUEUE = "requeue"  # it never ran (or was preempted): back to PENDING
    LOST = "lost"  # it cannot be accounted for: kill what is left, end it LOST


@dataclass(frozen=True, slots=True)
class Rule:
    verdict: Verdict
    reason: str = ""
    kill: bool = False  # kill whatever of the job is still running before acting


def decide(state: JobState, trace: Trace) -> Rule:
    """The restart rule for one job (see docs/architecture.md, "Recovery rules")."""
    if state in TERMINAL_STATES:
        return Rule(Verdict.KEEP)
    if state in (JobState.PENDING, JobState.HELD, JobState.PREEMPTED):
        # A waiting job has no process. One found alive is a leftover from an earlier run that
        # must not keep the devices of the next one.
        verdict = Verdict.REQUEUE if state is JobState.PREEMPTED else Verdict.KEEP
        return Rule(verdict, "requeued after preemption" if state is JobState.PREEMPTED else "", kill=trace.alive)
    # STARTING, RUNNING, SUSPENDED: the job was launched, or was being launched.
    if trace.status is Record.OK:
        # The shim writes the status last; one still holding its lock is in its final instant.
        return Rule(Verdict.FINISH, kill=trace.alive)
    if trace.status is Record.TORN:
        return Rule(Verdict.LOST, "its exit status record (status.json) is unreadable", kill=trace.alive)
    if trace.alive:
        if trace.shim is Record.OK:
            return Rule(Verdict.ADOPT, "re-adopted after daemon restart")
        if trace.locked and state is JobState.STARTING:
            return Rule(Verdict.KEEP, "its shim is still launching it")  # shim.json comes next
        return Rule(Verdict.LOST, f"its supervisor runs but its record (shim.json) is {trace.shim.value}",
                    kill=True)
    if state is JobState.STARTING and trace.shim is Record.ABSENT:
        # No shim holds the launch and none forked the job: it never ran. The engine revokes the
        # launch (so no late shim runs it) before requeueing.
        return Rule(Verdict.REQUEUE, "daemon stopped before the job was launched; requeued")
    if trace.shim is Record.TORN:
        return Rule(Verdict.LOST, "its supervisor is gone and its record (shim.json) is unreadable")
    return Rule(Verdict.LOST, "job ended while the daemon was down and left no exit status")


# States in which a job that never launched (no job directory) is left as it is by its rule: a restart
# with 100k queued jobs passes over them without asking `decide` of each (the rule stays the one above).
QUIET_UNLAUNCHED: frozenset[JobState] = frozenset(
    state for state in JobState if decide(state, NEVER_LAUNCHED) == Rule(Verdict.KEEP))


def outcome(status: ExitStatus, stop: StopRequest | None) -> tuple[JobState, str]:
    """The final state of a job that ended with `status`, given the stop the daemon asked for (if any).

    A FAILED stop is the daemon's own verdict (launch deadline, GPU fault, GPU memory): its reason
    says more than how the process died."""
    if stop is not None and stop.final is JobState.FAILED:
        return stop.final, stop.reason
    if status.error:
        return JobState.FAILED, f"could not start: {status.error}"
    if stop is not None:
        return stop.final, stop.reason
    if status.signal is not None:
        return JobState.FAILED, f"killed by signal {signame(status.signal)}"
    if status.exit_code == 0:
        return JobState.COMPLETED, "exit code 0"
    return JobState.FAILED, f"exit code {status.exit_code}"


def path_to(current: JobState, final: JobState) -> list[JobState]:
    """Legal transitions from `current` to `final`: a STARTING job whose status shows it ran passes
    through RUNNING (a crash can land between the shim's exec and the RUNNING commit). A target
    that cannot be reached ends the job LOST (or FAILED where LOST is not allowed)."""
    if final in TRANSITIONS[current]:
        return [final]
    if JobState.RUNNING in TRANSITIONS[current] and final in TRANSITIONS[JobState.RUNNING]:
        return [JobState.RUNNING, final]
    return [fallback(current)]


def fallback(current: JobState) -> JobState:
    """Where a job goes when nothing else explains it."""
    allowed = TRANSITIONS[current]
    for state in (JobState.LOST, JobState.FAILED, JobState.CANCELLED):
        if state in allowed:
            return state
    return current  # terminal already


def signame(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)
