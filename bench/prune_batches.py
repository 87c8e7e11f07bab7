"""How long pruning holds the event loop: each batch of `Store.prune_finished`, timed, over a state
with many finished jobs (a big array cancelled, the submits of a benchmark).

The daemon prunes on its loop, 500 jobs a batch, yielding between batches: a batch is how long every
request waits behind it. Baseline, in the same run over a copy of the same database: each batch
working out the cutoff (the newest finished job beyond `max_finished_jobs`) itself, as before round
21; against the daemon's way, the cutoff worked out once for the run (`Store.prune_cutoff`).

    python bench/prune_batches.py                 # 70,000 finished jobs, keep 10,000 (the default)
    python bench/prune_batches.py --finished 20000 --keep 5000
    python bench/prune_batches.py --quick         # 3,000 finished, keep 1,000: a smoke run
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import harness as h

from gpusched.arrayspec import parse_array_spec
from gpusched.daemon.retention import Cutoff
from gpusched.daemon.store import Store
from gpusched.model import JobState

ARRAY = 10_000  # tasks per array: the largest a default daemon takes


def fill(path: str, finished: int) -> None:
    """`finished` cancelled array tasks, ended one after another, with their CANCELLED transitions."""
    store = Store(path)
    left, now = finished, 1000.0
    while left:
        count = min(ARRAY, left)
        _, tasks = store.submit_array(uid=1000, gid=1000, user="u", spec=h.spec(["true"]), now=now,
                                      array=parse_array_spec(f"1-{count}"))
        with store.batch():
            for task in tasks:
                now += 0.001
                store.transition(task, JobState.CANCELLED, now=now, reason="cancelled", ended_at=now)
        left -= count
    store.close()


def prune(path: str, keep: int, once: bool) -> list[float]:
    """Seconds of each batch until nothing is left to prune (with `once`, the first holds the cutoff)."""
    store = Store(path)
    times: list[float] = []
    t0 = time.perf_counter()
    cutoff: Cutoff | None = store.prune_cutoff(keep) if once else None
    while True:
        ids = store.prune_finished(ended_before=0.0, keep=keep, cutoff=cutoff)
        times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        if not ids:
            store.close()
            return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--finished", type=int, default=70_000, help="finished jobs in the database")
    parser.add_argument("--keep", type=int, default=10_000, help="max_finished_jobs")
    parser.add_argument("--quick", action="store_true", help="3,000 finished, keep 1,000")
    args = parser.parse_args()
    finished, keep = (3000, 1000) if args.quick else (args.finished, args.keep)
    print(h.machine_line())
    with tempfile.TemporaryDirectory(prefix="gpb-") as tmp:
        source = os.path.join(tmp, "filled.db")
        fill(source, finished)
        table = h.Table(["cutoff", "batches", "longest batch ms", "median batch ms", "all batches s"])
        medians, totals = {}, {}
        for name, once in (("each batch its own (baseline)", False), ("once per run (the daemon's)", True)):
            copy = os.path.join(tmp, f"{once}.db")
            shutil.copy(source, copy)
            times = prune(copy, keep, once)
            medians[once], totals[once] = h.median(times), sum(times)
            table.add(name, len(times), 1000 * max(times), 1000 * medians[once], totals[once])
        print(f"pruning {finished - keep} of {finished} finished jobs, keep {keep}, 500 a batch "
              "(the daemon's first batch also works out the cutoff)")
        print(table.render())
        print(f"ratios: a batch's median {1000 * medians[True]:.1f} ms = baseline ({1000 * medians[False]:.1f} ms) "
              f"/ {medians[False] / medians[True]:.1f}; all batches {totals[True]:.2f} s = baseline "
              f"({totals[False]:.2f} s) / {totals[False] / totals[True]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
