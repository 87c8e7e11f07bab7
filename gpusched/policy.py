"""The scheduling policy as an extension point: what every policy implements, and what it may add.

A policy is any object with `plan(snapshot, now) -> list[Action]` (`Policy`): the daemon and the
replay drive it exactly as they drive the built-in fair-share `core.Scheduler` (docs/policies.md,
docs/scheduling.md section 7). Everything else the daemon uses is optional, one small protocol per
capability below; the daemon asks `isinstance(policy, Capability)` where it needs one and does
without it otherwise (docs/policies.md lists what each absence costs). Pure like the core: no
imports of plug-ins here (gpusched/policies.py loads them).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from gpusched.core.actions import Action, Snapshot
from gpusched.core.estimate import Estimate
from gpusched.core.fairshare import FairShare
from gpusched.core.sched_core import SchedulerConfig
from gpusched.model import Job

__all__ = [
    "CarriesOver", "ChargesDowntime", "Estimates", "Explains", "Incremental", "LearnsRunTimes", "OrdersByFairness",
    "Pins", "Policy", "PolicyContext", "SharesFairly", "explanation", "fairness_order", "is_incremental",
]


@dataclass(frozen=True, slots=True)
class PolicyContext:
    """What a policy class is constructed with: `Class(context)`.

    `scheduler`: the core's knobs as the daemon builds them from `[fairness]`, `[scheduler]` and
    `[mig]` (the replay: from its config file), so a policy can honour the site's user weights;
    `options`: the `[scheduler.policy_options]` table, the policy's own settings, as plain TOML data.
    """

    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    options: Mapping[str, Any] = field(default_factory=dict)


@runtime_checkable
class Policy(Protocol):
    """The minimum: decide what to do now from what the snapshot shows.

    Called on every event (submit, exit, cancel, tick); the engine applies the actions, commits their
    results, then may call again. A job left pending simply reappears in the next snapshot.
    """

    def plan(self, snapshot: Snapshot, now: float) -> list[Action]: ...


@runtime_checkable
class Incremental(Protocol):
    """Keeps its own queue: told of each job that becomes PENDING or leaves it, and shown
    `snapshot.pending == ()` (no O(pending) copy per pass). Without it the snapshot carries every
    pending job whose dependencies are met, in submission order."""

    incremental: bool

    def submit(self, job: Job) -> None: ...

    def remove(self, job_id: int) -> None: ...


@runtime_checkable
class SubmitsMany(Protocol):
    """An Incremental policy that takes many jobs at once (a restart's whole queue) as it would take each
    in turn, only faster; the engine submits them one by one to a policy without it."""

    def submit_many(self, jobs: list[Job]) -> None: ...


def submit_all(queue: Incremental, jobs: list[Job]) -> None:
    """Tell an Incremental policy of `jobs`, all now PENDING: at once where it can take them so."""
    if isinstance(queue, SubmitsMany) and _submit_many_is_current(type(queue)):
        queue.submit_many(jobs)
    else:
        for job in jobs:
            queue.submit(job)


def _submit_many_is_current(cls: type) -> bool:
    """Whether `submit_many` is defined where `submit` is, or below: a plug-in that subclasses the
    built-in scheduler and overrides only `submit` must see every job through its own `submit`."""
    def owner(name: str) -> type | None:
        return next((k for k in cls.__mro__ if name in vars(k)), None)

    many, one = owner("submit_many"), owner("submit")
    return many is not None and one is not None and issubclass(many, one)


@runtime_checkable
class Explains(Protocol):
    """`gpusched show` / `queue` say why a pending job waits in the policy's own words."""

    def explain(self, job_id: int) -> str: ...


@runtime_checkable
class OrdersByFairness(Protocol):
    """`gpusched queue --order fairness`: pending job ids in the order the policy would start them."""

    def fairness_order(self) -> list[int]: ...


@runtime_checkable
class LearnsRunTimes(Protocol):
    """Told of each job's end: a run it may learn from, then that nothing of the job need be kept."""

    def observe_end(self, job: Job) -> None: ...

    def forget_ended(self, job_id: int) -> None: ...


@runtime_checkable
class Estimates(Protocol):
    """`gpusched show`: a job's run-time estimate and when it is expected to start or end."""

    def estimate(self, job: Job) -> Estimate: ...

    def expected_start(self, job_id: int) -> float | None: ...

    def expected_end(self, job_id: int) -> float | None: ...


@runtime_checkable
class Pins(Protocol):
    """Serves `PreemptJob(mode="checkpoint"|"suspend")`: a checkpointed job comes back pinned to the
    devices holding its state, and a preemption the engine could not carry out is reported back."""

    def pin(self, job_id: int, uuids: Iterable[str]) -> None: ...

    def preempt_failed(self, job_id: int) -> None: ...


@runtime_checkable
class ChargesDowntime(Protocol):
    """Charges the users of jobs that ended while no daemon ran (restart recovery)."""

    def charge_ended_while_away(self, job: Job) -> None: ...


@runtime_checkable
class SharesFairly(Protocol):
    """Has fair-share state: `top` and `stats` show each user's weight from it."""

    fair: FairShare


@runtime_checkable
class CarriesOver(Protocol):
    """A reload's new instance takes over what the old one learned (else every HANDED_OVER
    export_*/load_* pair the two both have is handed over, and nothing else)."""

    def carry_over(self, old: Any) -> None: ...


def is_incremental(policy: object) -> bool:
    """True for a policy that keeps its own queue (and says so with `incremental = True`).

    A plain attribute read: the engine asks on every state change. That such a policy also has
    submit and remove is checked once, when it is loaded (gpusched/policies.py)."""
    return bool(getattr(policy, "incremental", False))


NO_EXPLANATION = "this policy gives no explanation"


def explanation(policy: object, job_id: int) -> str | None:
    """The policy's own reason a pending job waits, or None when it gives none."""
    if isinstance(policy, Explains):
        return str(policy.explain(job_id))
    return None


def fairness_order(policy: object) -> list[int] | None:
    """Pending job ids in the policy's start order, or None when it has no such order."""
    if isinstance(policy, OrdersByFairness):
        return list(policy.fairness_order())
    return None
