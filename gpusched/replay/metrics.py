"""Figures of one replay, with the exact definitions docs/replay.md gives (and `--json` prints).

Waits come from `core.accounting.waits` (runnable -> started, as `gpusched stats` measures them),
and Jain's index from `core.accounting.jain_index`, so a replay figure means what the daemon's does.
Service is integrated from the simulator's allocation segments: for every policy but fifo-timeslice
that equals `accounting.service_in_window` (compute fraction x wall time held, not suspended); time-sliced jobs
hold 1/k of a GPU while k jobs share it, which a fixed allocation cannot express.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypedDict

from gpusched.core.accounting import jain_index, waits
from gpusched.core.queue import request_fraction
from gpusched.model import Job, JobState
from gpusched.replay.sim import SimResult

JSON_KEYS: tuple[str, ...] = (
    "policy", "jobs", "skipped", "makespan_s", "jct_mean_s", "jct_p50_s", "jct_p99_s", "wait_mean_s",
    "wait_p50_s", "wait_p99_s", "utilization", "jain_index", "share_error_max", "mig_reconfigurations",
    "decision_us_mean", "useful_utilization", "by_class", "by_user", "estimator",
)


class Group(TypedDict):
    """Waits and completion times of one class or user (`by_class` / `by_user` in `--json`)."""

    jobs: int
    wait_mean_s: float
    wait_p99_s: float
    jct_mean_s: float
    jct_p99_s: float


class EstimatorError(TypedDict):
    """How far the run-time estimates were from the run times (`estimator` in `--json`)."""

    jobs: int  # completed jobs that were started with an estimate
    median_ratio: float  # median of estimate / run time (1 = exact; > 1 over-estimates)
    within_2x: float  # fraction of jobs whose estimate was within a factor 2 of the run time
    mean_abs_error_s: float


class Summary(TypedDict):
    """One policy's `--json` object (docs/replay.md defines every key)."""

    policy: str
    jobs: int
    skipped: int
    makespan_s: float
    jct_mean_s: float
    jct_p50_s: float
    jct_p99_s: float
    wait_mean_s: float
    wait_p50_s: float
    wait_p99_s: float
    utilization: float
    jain_index: float
    share_error_max: float
    mig_reconfigurations: int
    decision_us_mean: float
    useful_utilization: float
    by_class: dict[str, Group]
    by_user: dict[str, Group]
    estimator: EstimatorError | None


MIN_ENTITLED = 0.01  # users entitled to < 1% of the contended service are left out of the fairness figures


@dataclass(frozen=True, slots=True)
class Fairness:
    """Per user: service received while backlogged, and what their weight entitled them to then."""

    received: Mapping[str, float]  # GPU-seconds
    entitled: Mapping[str, float]

    def ratios(self) -> dict[str, float]:
        total = sum(self.entitled.values())
        return {u: self.received[u] / e for u, e in self.entitled.items() if total > 0 and e >= MIN_ENTITLED * total}

    @property
    def jain(self) -> float:
        return jain_index(list(self.ratios().values()))

    @property
    def share_error_max(self) -> float:
        return max((abs(r - 1.0) for r in self.ratios().values()), default=0.0)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); 0.0 for no values."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def finished(jobs: Sequence[Job]) -> list[Job]:
    """Jobs that ran to their end (COMPLETED, or stopped at their time limit)."""
    return [j for j in jobs if j.state in (JobState.COMPLETED, JobState.TIMEOUT) and j.ended_at is not None]


def fairness(result: SimResult, weights: Mapping[str, float]) -> Fairness:
    """GPS-style comparison over the time users are backlogged (have a job waiting).

    While >= 2 users are backlogged, the service rate R(t) going to backlogged users is what a
    weighted-fair scheduler would split among them by weight, each capped at what it can use at
    that moment (its pending and running jobs' GPUs; max-min "water-filling", so a user waiting
    with one 0.1-GPU job is not entitled to half the node). Entitlement and the rate each user
    receives are integrated over time. A job the policy can never run (FAILED unsatisfiable)
    counts for nothing.
    """
    events: list[tuple[float, int, str, float]] = []  # (time, kind, user, delta); kind 0 rate, 1 backlog, 2 demand
    for job in result.jobs:
        for t0, t1, frac in result.segments.get(job.id, ()):
            events.append((t0, 0, job.user, frac))
            events.append((t1, 0, job.user, -frac))
        if job.state is JobState.FAILED and job.history and job.history[-1].reason.startswith("unsatisfiable"):
            continue  # it can never use anything: no entitlement (else the figure says when a planner
            # got round to refusing it, FIFO at the head, not how fair it was)
        want = request_fraction(job.spec.request)
        since: float | None = None
        for tr in job.history:
            if tr.state is JobState.PENDING:
                if since is None:
                    since = tr.at
            elif since is not None:
                if tr.at > since:
                    events.append((since, 1, job.user, 1.0))
                    events.append((tr.at, 1, job.user, -1.0))
                    events.append((since, 2, job.user, want))
                    events.append((tr.at, 2, job.user, -want))
                since = None
    events.sort(key=lambda e: (e[0], e[1]))
    rate: dict[str, float] = {}
    backlog: dict[str, int] = {}
    waiting: dict[str, float] = {}  # GPUs' worth of pending jobs
    received: dict[str, float] = {}
    entitled: dict[str, float] = {}
    last = events[0][0] if events else 0.0
    for t, kind, user, delta in events:
        dt = t - last
        if dt > 0:
            busy = sorted(u for u, n in backlog.items() if n > 0)
            if len(busy) >= 2:
                total_rate = sum(rate.get(u, 0.0) for u in busy)
                caps = {u: rate.get(u, 0.0) + waiting.get(u, 0.0) for u in busy}
                fair = water_fill(total_rate, {u: weights.get(u, 100.0) for u in busy}, caps)
                for u in busy:
                    received[u] = received.get(u, 0.0) + rate.get(u, 0.0) * dt
                    entitled[u] = entitled.get(u, 0.0) + fair[u] * dt
            last = t
        if kind == 0:
            rate[user] = rate.get(user, 0.0) + delta
        elif kind == 1:
            backlog[user] = backlog.get(user, 0) + int(delta)
        else:
            waiting[user] = max(0.0, waiting.get(user, 0.0) + delta)
    return Fairness({u: received.get(u, 0.0) for u in entitled}, entitled)


def water_fill(total: float, weights: Mapping[str, float], caps: Mapping[str, float]) -> dict[str, float]:
    """Split `total` by weight, no one above their cap, what the capped leave going to the rest."""
    out: dict[str, float] = {}
    left_total = total
    left = sorted(weights, key=lambda u: (caps[u] / weights[u], u))
    left_w = sum(weights[u] for u in left)
    for i, u in enumerate(left):
        share = left_total * weights[u] / left_w if left_w > 0 else 0.0
        if caps[u] <= share:
            out[u] = caps[u]
            left_total -= caps[u]
            left_w -= weights[u]
            continue
        for v in left[i:]:  # everyone left can use more than their weighted share
            out[v] = left_total * weights[v] / left_w if left_w > 0 else 0.0
        break
    return out


def summarize(result: SimResult, weights: Mapping[str, float], skipped_by_parser: int) -> Summary:
    """The `--json` object of one policy (keys exactly JSON_KEYS)."""
    done = finished(result.jobs)
    jct = [j.ended_at - j.submitted_at for j in done if j.ended_at is not None]
    per_job = [waits(j) for j in result.jobs]
    job_waits = [sum(w.seconds for w in ws) for ws in per_job if ws]
    makespan = max(0.0, result.end - result.start)
    used = sum((t1 - t0) * f for segs in result.segments.values() for t0, t1, f in segs)
    util = used / (result.capacity_gpus * makespan) if makespan > 0 else 0.0
    asked = sum(result.requested.get(j.id, 0.0) for j in done if j.state is JobState.COMPLETED)
    useful = asked / (result.capacity_gpus * makespan) if makespan > 0 else 0.0
    fair = fairness(result, weights)
    out: Summary = {
        "policy": result.policy,
        "jobs": len(done),
        "skipped": skipped_by_parser + result.unsatisfiable + result.stuck,
        "makespan_s": round(makespan, 3),
        "jct_mean_s": round(sum(jct) / len(jct), 3) if jct else 0.0,
        "jct_p50_s": round(percentile(jct, 50), 3),
        "jct_p99_s": round(percentile(jct, 99), 3),
        "wait_mean_s": round(sum(job_waits) / len(job_waits), 3) if job_waits else 0.0,
        "wait_p50_s": round(percentile(job_waits, 50), 3),
        "wait_p99_s": round(percentile(job_waits, 99), 3),
        "utilization": round(util, 6),
        "jain_index": round(fair.jain, 6),
        "share_error_max": round(fair.share_error_max, 6),
        "mig_reconfigurations": result.mig_reconfigurations,
        "decision_us_mean": round(sum(result.plan_us) / len(result.plan_us), 3) if result.plan_us else 0.0,
        "useful_utilization": round(useful, 6),
        "by_class": _groups(result.jobs, lambda j: j.spec.job_class),
        "by_user": _groups(result.jobs, lambda j: j.user),
        "estimator": estimator_error(result),
    }
    assert tuple(out) == JSON_KEYS
    return out


def _groups(jobs: Sequence[Job], key: Callable[[Job], str]) -> dict[str, Group]:
    waits_by: dict[str, list[float]] = {}
    jct_by: dict[str, list[float]] = {}
    for job in jobs:
        k = key(job)
        ws = waits(job)
        if ws:
            waits_by.setdefault(k, []).append(sum(w.seconds for w in ws))
        if job.state in (JobState.COMPLETED, JobState.TIMEOUT) and job.ended_at is not None:
            jct_by.setdefault(k, []).append(job.ended_at - job.submitted_at)
    out: dict[str, Group] = {}
    for k in sorted(set(waits_by) | set(jct_by)):
        w, c = waits_by.get(k, []), jct_by.get(k, [])
        out[k] = {"jobs": len(c), "wait_mean_s": round(sum(w) / len(w), 3) if w else 0.0,
                  "wait_p99_s": round(percentile(w, 99), 3), "jct_mean_s": round(sum(c) / len(c), 3) if c else 0.0,
                  "jct_p99_s": round(percentile(c, 99), 3)}
    return out


def estimator_error(result: SimResult) -> EstimatorError | None:
    """Estimate at the last start vs the run time, over completed jobs; None for a policy without estimates."""
    pairs = [(result.expected[j.id], j.ended_at - j.started_at) for j in result.jobs
             if j.state is JobState.COMPLETED and j.id in result.expected and j.started_at is not None
             and j.ended_at is not None and j.ended_at > j.started_at]
    if not pairs:
        return None
    ratios = [e / r for e, r in pairs]
    return {"jobs": len(pairs), "median_ratio": round(percentile(ratios, 50), 4),
            "within_2x": round(sum(1 for q in ratios if 0.5 <= q <= 2.0) / len(ratios), 4),
            "mean_abs_error_s": round(sum(abs(e - r) for e, r in pairs) / len(pairs), 3)}


def user_service(result: SimResult) -> dict[str, float]:
    """GPU-seconds each user received over the whole run (for the plot)."""
    out: dict[str, float] = {}
    for job in result.jobs:
        for t0, t1, f in result.segments.get(job.id, ()):
            out[job.user] = out.get(job.user, 0.0) + (t1 - t0) * f
    return out


def utilization_series(result: SimResult, bins: int = 200) -> tuple[list[float], list[float]]:
    """(bin start times, allocated fraction of capacity per bin) from the allocation timeline."""
    span = result.end - result.start
    if span <= 0 or not result.timeline:
        return [], []
    width = span / bins
    acc = [0.0] * bins
    points = [*result.timeline, (result.end, 0.0)]
    for (t0, level), (t1, _) in itertools.pairwise(points):
        if t1 <= t0 or level == 0:
            continue
        first = min(int((t0 - result.start) / width), bins - 1)
        last = min(int((t1 - result.start) / width), bins - 1)
        for b in range(first, last + 1):  # overlap of [t0, t1) with each bin it touches
            lo = max(t0, result.start + b * width)
            hi = min(t1, result.start + (b + 1) * width) if b < bins - 1 else t1
            if hi > lo:
                acc[b] += level * (hi - lo)
    xs = [result.start + i * width for i in range(bins)]
    return xs, [a / (width * result.capacity_gpus) for a in acc]
