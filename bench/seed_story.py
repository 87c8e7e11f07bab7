"""The seed's story as a replay: a trainer holds the node, two users want quick interactive answers.

One user submits six `--requeue` 24-hour training jobs (one whole H100 each) at t=0 on a 4-GPU node;
two other users each submit a 5-minute `share 0.1` interactive inference job every 10 minutes for
36 hours, both on the same beat (so their jobs overlap), starting a minute after the trainer.
The questions (issue 11): do the interactive users wait seconds rather than a day (p99 wait
<= 60 s and >= 20x better than fifo-whole), does the trainer finish about when it would under
FIFO (makespan within 5%), and is the split fair (Jain >= 0.95)?

    python bench/seed_story.py [--out trace.csv] [--json] [--config replay.toml]

writes the trace (CSV, docs/replay.md) and replays it under every policy, printing the table and
the targets. `write_trace` is what the test suite replays (tests/replay/test_seed_story.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Mapping
from typing import Any

HOURS = 3600.0
GPUS = "H100-80GB:4"
TRAINER_JOBS = 6
TRAIN_S = 24 * HOURS
INTERACTIVE_USERS = ("alice", "bob")
INTERACTIVE_S = 300.0
EVERY_S = 600.0
STORY_S = 36 * HOURS
FIRST_INTERACTIVE_S = 60.0
SHARE = 0.1
SHARE_MEM_MIB = 8192


def rows() -> list[str]:
    out = [f"0,{TRAIN_S:.0f},trainer,1,,,batch,1,train-{k}" for k in range(TRAINER_JOBS)]
    t = FIRST_INTERACTIVE_S
    k = 0
    while t < STORY_S:
        for user in INTERACTIVE_USERS:
            out.append(f"{t:.0f},{INTERACTIVE_S:.0f},{user},,{SHARE},{SHARE_MEM_MIB},interactive,0,infer-{user}-{k}")
        t += EVERY_S
        k += 1
    return out


def write_trace(path: str) -> str:
    """Write the story as a replay CSV and return its path."""
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("submit_time,duration,user,gpus,share,gpu_mem,class,requeue,name\n")
        fh.write("\n".join(rows()) + "\n")
    return path


def targets(ours: Mapping[str, Any], fifo: Mapping[str, Any], trainer_end: Mapping[str, float]) -> list[str]:
    """Each target of issue 11 for this story, with the figure and whether it is met."""
    inter = ours["by_class"]["interactive"]["wait_p99_s"]
    fifo_inter = fifo["by_class"]["interactive"]["wait_p99_s"]
    ratio = fifo_inter / inter if inter > 0 else float("inf")
    span = trainer_end["gpusched"] / trainer_end["fifo-whole"]
    lines = [
        f"interactive p99 wait {inter:.1f} s (target <= 60 s): {'met' if inter <= 60 else 'NOT met'}",
        f"fifo-whole / gpusched interactive p99 wait = {ratio:.0f}x (target >= 20x): "
        f"{'met' if ratio >= 20 else 'NOT met'}",
        f"trainer makespan gpusched / fifo-whole = {span:.3f} (target <= 1.05): {'met' if span <= 1.05 else 'NOT met'}",
        f"Jain {ours['jain_index']:.3f} (target >= 0.95): {'met' if ours['jain_index'] >= 0.95 else 'NOT met'}",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    from gpusched.replay.runner import render_table, run_replay

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="where to write the trace (default: a temporary file)")
    parser.add_argument("--json", action="store_true", help="one JSON object per policy")
    parser.add_argument("--config", help="replay TOML (docs/replay.md), e.g. [replay] checkpoint = false")
    args = parser.parse_args(argv)
    path = args.out or os.path.join(tempfile.mkdtemp(prefix="seed-story-"), "seed_story.csv")
    write_trace(path)
    report = run_replay(path, gpus=GPUS, config_path=args.config, freeze_trace=True)
    if args.json:
        for s in report.summaries:
            print(json.dumps(s))
        return 0
    print(render_table(report))
    by_policy = {s["policy"]: s for s in report.summaries}
    trainer_end = {r.policy: max(j.ended_at or 0.0 for j in r.jobs if j.user == "trainer") for r in report.results}
    print()
    print("\n".join(targets(by_policy["gpusched"], by_policy["fifo-whole"], trainer_end)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
