"""Who got what, and who waited how long: figures computed from job histories over a window.

Pure: jobs (with their committed state histories) and the window are passed in. The daemon's
`stats` and trace replay both measure with these functions, so a figure means the same thing in
production and in a benchmark. The waiting figures follow `perf sched latency`: a delay runs from
the moment a job became runnable (submitted, released, requeued) to the moment it started.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from gpusched.model import ACTIVE_STATES, Job, JobState


@dataclass(frozen=True, slots=True)
class UserStats:
    """One user's figures over a window. Service is in GPU-seconds (compute fraction x wall time not suspended)."""

    user: str
    weight: float
    jobs: int  # jobs that were pending or active during the window
    starts: int  # how many times their jobs were started ("switches")
    runtime_s: float  # wall seconds their jobs held devices
    service_gpu_s: float
    share: float  # of all service delivered in the window
    entitled: float  # weight / sum of weights of users with work in the window
    wait_avg_s: float
    wait_max_s: float
    wait_max_at: float | None  # when the longest wait ended (the job started)


@dataclass(frozen=True, slots=True)
class Wait:
    user: str
    job_id: int
    runnable_at: float
    started_at: float

    @property
    def seconds(self) -> float:
        return self.started_at - self.runnable_at


def state_spans(job: Job, states: Collection[JobState]) -> list[tuple[float, float | None]]:
    """[start, end) spans of the job's history spent in `states`; end None: it is in them still."""
    spans: list[tuple[float, float | None]] = []
    since: float | None = None
    for t in job.history:
        if t.state in states:
            if since is None:
                since = t.at
        elif since is not None:
            spans.append((since, t.at))
            since = None
    if since is not None:
        spans.append((since, None))
    return spans


def active_intervals(job: Job, now: float) -> list[tuple[float, float]]:
    """[start, end) spans during which the job held its devices (STARTING, RUNNING, SUSPENDED)."""
    return [(start, now if end is None else end) for start, end in state_spans(job, ACTIVE_STATES)]


def waits(job: Job) -> list[Wait]:
    """Each runnable -> started delay of a job (a requeued job can wait more than once)."""
    out: list[Wait] = []
    runnable: float | None = None
    for t in job.history:
        if t.state is JobState.PENDING:
            runnable = t.at
        elif t.state is JobState.HELD:
            runnable = None  # time on hold is the owner's choice, not the scheduler's delay
        elif t.state is JobState.STARTING and runnable is not None:
            out.append(Wait(job.user, job.id, runnable, t.at))
            runnable = None
    return out


_CHARGED = frozenset({JobState.STARTING, JobState.RUNNING})  # as the scheduler charges: not while suspended


def service_in_window(job: Job, since: float, now: float) -> tuple[float, float]:
    """(wall seconds holding devices, GPU-seconds of service) that fall inside [since, now]. Service
    leaves out time suspended, as the scheduler does (its share and Jain's index measure what it
    balances); the held time counts it (the devices were the job's)."""
    fraction = job.allocation.compute_fraction if job.allocation is not None else 0.0
    wall = sum(max(0.0, min(end, now) - max(start, since)) for start, end in active_intervals(job, now))
    charged = sum(max(0.0, min(now if end is None else end, now) - max(start, since))
                  for start, end in state_spans(job, _CHARGED))
    return wall, charged * fraction


def user_stats(jobs: Iterable[Job], since: float, now: float, weight_of: Callable[[str], float]) -> list[UserStats]:
    """Per-user figures for every user with work pending or running in [since, now], by user name."""
    per_user: dict[str, dict[str, float]] = {}
    longest: dict[str, Wait] = {}
    wait_lists: dict[str, list[float]] = {}
    for job in jobs:
        if not _touches(job, since, now):
            continue
        acc = per_user.setdefault(job.user, {"jobs": 0, "starts": 0, "runtime": 0.0, "service": 0.0})
        acc["jobs"] += 1
        wall, service = service_in_window(job, since, now)
        acc["runtime"] += wall
        acc["service"] += service
        for w in waits(job):
            if since <= w.started_at <= now:
                acc["starts"] += 1
                wait_lists.setdefault(job.user, []).append(w.seconds)
                if job.user not in longest or w.seconds > longest[job.user].seconds:
                    longest[job.user] = w
    total_service = sum(a["service"] for a in per_user.values())
    total_weight = sum(weight_of(u) for u in per_user)
    out = []
    for user in sorted(per_user):
        acc = per_user[user]
        delays = wait_lists.get(user, [])
        out.append(UserStats(
            user=user, weight=weight_of(user), jobs=int(acc["jobs"]), starts=int(acc["starts"]),
            runtime_s=acc["runtime"], service_gpu_s=acc["service"],
            share=acc["service"] / total_service if total_service else 0.0,
            entitled=weight_of(user) / total_weight if total_weight else 0.0,
            wait_avg_s=sum(delays) / len(delays) if delays else 0.0,
            wait_max_s=longest[user].seconds if user in longest else 0.0,
            wait_max_at=longest[user].started_at if user in longest else None,
        ))
    return out


def jain_index(values: Sequence[float]) -> float:
    """Jain's fairness index (sum x)^2 / (n * sum x^2): 1.0 is perfectly even, 1/n is one takes all."""
    if not values:
        return 1.0
    top = max(abs(v) for v in values)
    if top and not 1e-100 < top < 1e100:
        # The index does not change with the scale, but squares of values this small (large)
        # underflow (overflow): 1e-159 squared is already inexact, and gave indices above 1.
        values = [v / top for v in values]
    squares = sum(v * v for v in values)
    return (sum(values) ** 2) / (len(values) * squares) if squares else 1.0


def fairness_index(stats: Sequence[UserStats]) -> float:
    """Jain's index over each user's service divided by their entitled share."""
    return jain_index([s.share / s.entitled for s in stats if s.entitled > 0])


def device_busy_fraction(jobs: Iterable[Job], since: float, now: float) -> dict[str, float]:
    """Device UUID -> fraction of [since, now] it was held by some job (by allocated compute fraction)."""
    span = max(now - since, 1e-9)
    busy: dict[str, float] = {}
    for job in jobs:
        if job.allocation is None:
            continue
        wall, _ = service_in_window(job, since, now)
        per_device = job.allocation.share if job.allocation.share is not None else 1.0
        for uuid in job.allocation.uuids:
            busy[uuid] = busy.get(uuid, 0.0) + wall * per_device / span
    return busy


_WORK = frozenset({JobState.PENDING, JobState.STARTING, JobState.RUNNING, JobState.SUSPENDED})


def _touches(job: Job, since: float, now: float) -> bool:
    """Was the job work during [since, now]: pending (runnable) or holding devices? A job that was
    only held (`submit --hold`, then cancelled) asked for nothing, and its user is entitled to no
    share for it (the instant between its PENDING and HELD is no work either)."""
    return any(start <= now and (end is None or (end > start and end >= since))
               for start, end in state_spans(job, _WORK))
