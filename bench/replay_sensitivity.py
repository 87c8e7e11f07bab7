"""Does the replay's verdict depend on the interference model? Every policy under each plausible setting.

Not a test. The interference defaults (docs/replay.md, "Interference model") come from a handful of
published measurements that scatter widely, so a policy ranking that held only at the defaults would
mean little. This replays TRACE under every policy for each combination of `mps_slowdown` and
`timeslice_overhead` over the measured range and prints, per setting, each policy's
`useful_utilization` (GPU-seconds the trace asked for, of completed jobs, over GPUs x makespan) and
mean job completion time, the ranking of the policies by each, and whether the ranking changes.

    python bench/replay_sensitivity.py TRACE [--gpus H100-80GB:8] [--times-from PODLIST] [--load 0.9]
    python bench/replay_sensitivity.py TRACE --quick    # two settings only (smoke)

The trace path is an argument: the repository ships no trace (docs/replay.md says where to get one).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpusched.replay.metrics import Summary
from gpusched.replay.policies import POLICIES, Interference, ReplayConfig
from gpusched.replay.runner import run_replay

DEFAULT = Interference()
# (label, value): the low and high ends are the measured extremes cited in docs/replay.md.
MPS_SLOWDOWN = (("none", 0.0), ("default", DEFAULT.mps_slowdown), ("high", 0.30))
TIMESLICE_OVERHEAD = (("low", 0.10), ("default", DEFAULT.timeslice_overhead), ("high", 0.30))


@dataclass(frozen=True, slots=True)
class Setting:
    """One interference model to replay under."""

    mps: tuple[str, float]
    timeslice: tuple[str, float]

    @property
    def label(self) -> str:
        return f"mps {self.mps[1]:.2f} ({self.mps[0]}), timeslice {self.timeslice[1]:.2f} ({self.timeslice[0]})"

    @property
    def is_default(self) -> bool:
        return self.mps[0] == "default" and self.timeslice[0] == "default"


def settings(quick: bool) -> list[Setting]:
    if quick:
        return [Setting(MPS_SLOWDOWN[0], TIMESLICE_OVERHEAD[1]), Setting(MPS_SLOWDOWN[1], TIMESLICE_OVERHEAD[1])]
    return [Setting(m, t) for m in MPS_SLOWDOWN for t in TIMESLICE_OVERHEAD]


def ranking(summaries: Sequence[Summary], key: str, descending: bool, fmt: str) -> str:
    """Policies best first, `=` between policies whose figures print the same (ties by name)."""
    sign = -1.0 if descending else 1.0
    ordered = sorted(summaries, key=lambda s: (sign * _value(s, key), s["policy"]))
    out = str(ordered[0]["policy"])
    for prev, cur in itertools.pairwise(ordered):
        same = fmt.format(_value(prev, key)) == fmt.format(_value(cur, key))
        out += f" {'=' if same else '>'} {cur['policy']}"
    return out


def _value(summary: Summary, key: str) -> float:
    row: Mapping[str, object] = summary
    value = row[key]
    assert isinstance(value, (int, float))
    return float(value)


def table(rows: list[tuple[Setting, list[Summary]]], key: str, fmt: str, descending: bool) -> list[str]:
    """A markdown table: one row per setting, one column per policy, then the ranking."""
    names = [str(s["policy"]) for s in rows[0][1]]
    out = [f"| setting | {' | '.join(names)} | ranking by {key} |",
           "| --- | " + " | ".join("---:" for _ in names) + " | --- |"]
    for setting, summaries in rows:
        cells = [fmt.format(_value(s, key)) for s in summaries]
        order = ranking(summaries, key, descending, fmt)
        mark = " **(default)**" if setting.is_default else ""
        out.append(f"| {setting.label}{mark} | {' | '.join(cells)} | {order} |")
    return out


def verdict(rows: list[tuple[Setting, list[Summary]]], key: str, fmt: str, descending: bool) -> str:
    """Whether the ranking by `key` is the same under every setting, and where it differs if not."""
    orders = {setting.label: ranking(s, key, descending, fmt) for setting, s in rows}
    distinct = sorted(set(orders.values()))
    if len(distinct) == 1:
        return f"ranking by {key}: the same under all {len(rows)} settings ({distinct[0]})"
    base = next((orders[setting.label] for setting, _ in rows if setting.is_default), orders[rows[0][0].label])
    differ = [label for label, order in orders.items() if order != base]
    return (f"ranking by {key}: CHANGES ({len(distinct)} different orders); differs from the default's ({base}) "
            "under: " + "; ".join(f"{label}: {orders[label]}" for label in differ))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("trace", help="trace file (generic CSV or Alibaba pod list)")
    ap.add_argument("--gpus", default="H100-80GB:8", help="simulated node, as gpuschedd --sim")
    ap.add_argument("--times-from", default=None, help="pod list to take times from (time-less Alibaba lists)")
    ap.add_argument("--load", type=float, default=None, help="offered load (Alibaba default 0.9)")
    ap.add_argument("--quick", action="store_true", help="two settings only (smoke run)")
    args = ap.parse_args(argv)
    began = time.perf_counter()
    rows: list[tuple[Setting, list[Summary]]] = []
    jobs = 0
    for setting in settings(args.quick):
        inter = Interference(timeslice_overhead=setting.timeslice[1], mps_slowdown=setting.mps[1])
        report = run_replay(args.trace, gpus=args.gpus, policies=POLICIES, load=args.load,
                            config=ReplayConfig(interference=inter), times_from=args.times_from)
        jobs = len(report.trace.jobs)
        rows.append((setting, report.summaries))
        print(f"# {setting.label}: replayed in {report.wall_s:.1f} s", file=sys.stderr, flush=True)
    print(f"trace {args.trace}: {jobs} jobs on {args.gpus}"
          + (f", times from {args.times_from}" if args.times_from else ""))
    print("mps_slowdown affects MPS shares (gpusched); timeslice_overhead affects time-sliced GPUs (fifo-timeslice); "
          "fifo-whole and static-mig run at speed 1 in every setting\n")
    print("\n".join(table(rows, "useful_utilization", "{:.3f}", descending=True)))
    print()
    print("\n".join(table(rows, "jct_mean_s", "{:,.0f}", descending=False)))
    print()
    print(verdict(rows, "useful_utilization", "{:.3f}", descending=True))
    print(verdict(rows, "jct_mean_s", "{:,.0f}", descending=False))
    print(f"\ntotal wall time {time.perf_counter() - began:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
