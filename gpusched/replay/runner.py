"""One call from a trace file to figures for every policy: what `gpusched replay` runs.

Kept apart from the CLI so tests and notebooks can replay without click, and so the client imports
none of this until the `replay` command actually runs.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gpusched.gcpause import LongLivedHeap, gc_paused
from gpusched.model import MigRequest
from gpusched.policies import load_policy
from gpusched.replay.metrics import JSON_KEYS, Summary, summarize
from gpusched.replay.policies import POLICIES, ReplayConfig, load_config, parse_gpus, setup, user_weights
from gpusched.replay.sim import SimResult, run_policy
from gpusched.replay.trace import Censored, Trace, load_trace
from gpusched.replay.tracefile import RowErrors, TraceError
from gpusched.replay.vendor import PolicySkipped, gpu_memory_mib, offered_profiles


@dataclass(slots=True)
class ReplayReport:
    """The parsed trace, each policy's raw result and its summary (in the order run)."""

    trace: Trace
    gpus: str
    results: list[SimResult] = field(default_factory=list)
    summaries: list[Summary] = field(default_factory=list)
    skipped: list[PolicySkipped] = field(default_factory=list)  # policies with no meaning on this node
    wall_s: float = 0.0


def resolve_policies(name: str) -> list[str]:
    """`--policy`: comma-separated built-in names and `package.module:Class` plug-ins, `all` for every
    built-in -> the list to run, each loaded once here so a bad one is reported before the trace is
    read (PolicyError, a ValueError naming --policy and the problem)."""
    chosen: list[str] = []
    for item in (part.strip() for part in name.split(",")):
        for spec in (POLICIES if item == "all" else (item,)):
            if spec not in chosen:
                load_policy(spec, field="--policy")
                chosen.append(spec)
    return chosen


def check_profiles(trace_path: str, trace: Trace, models: Sequence[str]) -> None:
    """A MIG profile none of the node's GPU models offers is a bad row (TraceError), not a job that
    some policies round up to a whole GPU and others can never run."""
    offered = offered_profiles(models)
    have = ", ".join(sorted(offered)) if offered else "none: AMD GPUs have no MIG"
    errs = RowErrors()
    for job in trace.jobs:
        if isinstance(job.request, MigRequest) and job.request.profile not in offered:
            errs.add(job.line, "mig", f"{job.request.profile} is not a MIG profile of "
                     f"{', '.join(sorted(set(models)))} (they offer {have})")
    if errs:
        raise TraceError(trace_path, errs.items, more=errs.more)


def run_replay(trace_path: str, *, gpus: str = "H100-80GB:8", fmt: str = "auto", config_path: str | None = None,
               policies: Sequence[str] = POLICIES, load: float | None = None, users: int = 16, seed: int = 1,
               config: ReplayConfig | None = None, limit: int | None = None,
               times_from: str | None = None, censored: Censored = "keep",
               freeze_trace: bool = False) -> ReplayReport:
    """Parse the trace once, then replay it under each policy. Raises TraceError / ValueError on bad input.

    `times_from`: an Alibaba pod list whose times a time-less pod list borrows (docs/replay.md).
    `freeze_trace`: the trace is read with the cyclic collector paused and then frozen, and so is
    what survives each full collection during the replay, so that no full collection walks them
    again (gcpause.py); for a process that only replays (the CLI), not for one that embeds this
    and keeps its own collector as it is.
    """
    began = time.perf_counter()
    models = parse_gpus(gpus)
    cfg = config if config is not None else load_config(config_path)
    memory = min(gpu_memory_mib(m) for m in models)
    with gc_paused():
        trace = load_trace(trace_path, fmt, gpus=len(models), gpu_memory_mib=memory, load=load, users=users,
                           seed=seed, limit=limit, times_from=times_from, censored=censored)
    check_profiles(trace_path, trace, models)
    heap = LongLivedHeap()
    if freeze_trace:  # and what survives each full collection during the replay (the jobs it built)
        heap.start(sweep_interval_s=None)
    try:
        if not trace.jobs:
            raise ValueError(f"{trace_path}: no replayable jobs ({trace.skipped_total} rows skipped)")
        report = ReplayReport(trace, gpus)
        weights = user_weights(trace.jobs, cfg)
        for name in policies:
            try:
                pol = setup(name, models, trace.jobs, cfg)
            except PolicySkipped as skip:
                report.skipped.append(skip)
                continue
            result = run_policy(pol, trace.jobs, cfg.interference)
            report.results.append(result)
            report.summaries.append(summarize(result, weights, trace.skipped_total))
    finally:
        heap.stop()
    if not report.results:
        raise ValueError("no policy runs on this node: " + "; ".join(str(s) for s in report.skipped))
    report.wall_s = time.perf_counter() - began
    return report


_FORMATS = {"utilization": "{:.3f}", "useful_utilization": "{:.3f}", "jain_index": "{:.3f}",
            "share_error_max": "{:.3f}", "decision_us_mean": "{:.1f}"}
_NESTED = ("by_class", "by_user", "estimator")  # in --json; the table shows a few figures from them


def render_table(report: ReplayReport) -> str:
    """Policies side by side, one figure per row, then each policy's node and anything that went wrong."""
    names = [str(s["policy"]) for s in report.summaries]
    rows: list[list[str]] = [["", *names]]
    for key in JSON_KEYS[1:]:
        if key in _NESTED:
            continue
        fmt = _FORMATS.get(key, "{:.1f}")
        cells = []
        for s in report.summaries:
            row: Mapping[str, object] = s
            v = row[key]
            cells.append(str(v) if isinstance(v, int) else fmt.format(v))
        rows.append([key, *cells])
    classes = sorted({c for s in report.summaries for c in s["by_class"]})
    if len(classes) > 1:
        for c in classes:
            for fig in ("wait_mean_s", "wait_p99_s"):
                rows.append([f"{c}_{fig}", *(f"{s['by_class'][c][fig]:.1f}" if c in s["by_class"] else "-"
                                             for s in report.summaries)])
    rows.append(["estimate_within_2x", *(f"{e['within_2x']:.3f}" if (e := s["estimator"]) is not None else "-"
                                         for s in report.summaries)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)) for r in rows]
    t = report.trace
    skipped = ", ".join(f"{n} {why}" for why, n in sorted(t.skipped.items())) or "none"
    head = [f"trace {t.path} ({t.format}): {len(t.jobs)} jobs, {len(t.users())} users; rows skipped: {skipped}"]
    if t.times_from is not None:
        head.append(f"times from {t.times_from}: {t.times_matched} rows by pod name, {t.times_drawn} rows drawn "
                    "by hash of seed and name")
    if t.time_scale != 1.0:
        head.append(f"arrival times scaled by {t.time_scale:.4g} to reach the requested load")
    if t.load_ignored is not None:
        head.append(f"--load not applied: {t.load_ignored}")
    head.append(f"node {report.gpus}")
    tail = []
    for r in report.results:
        extra = []
        if r.unsatisfiable:
            extra.append(f"{r.unsatisfiable} jobs it can never run")
        if r.stuck:
            extra.append(f"{r.stuck} jobs never started")
        if r.mig_errors:
            extra.append(f"{len(r.mig_errors)} MIG operations refused by the driver")
        tail.append(f"  {r.policy}: {r.node}; replayed in {r.wall_s:.1f} s"
                    + (f"; {'; '.join(extra)}" if extra else ""))
    tail += [f"  {s.policy}: skipped: {s.reason}" for s in report.skipped]
    return "\n".join([*head, "", *lines, "", "policies:", *tail, f"total wall time {report.wall_s:.1f} s"])
