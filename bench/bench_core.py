"""Cost of the scheduling core: submit, one scheduling pass, and a completion, vs. queue size.

Not a test. Prints microseconds per operation (means; the idle pass also as a median, "pass p50")
at 1k / 10k / 100k pending jobs from 100 and 1,000 users, and the growth ratio from the smallest
to the largest queue (measured in the same run, so the ratio is comparable across machines even
when the absolute figures are not).

    python bench/bench_core.py            # full run (about a minute)
    python bench/bench_core.py --quick    # smoke version (seconds)

Operations (incremental mode, as the daemon should run it):
- submit: `Scheduler.submit(job)` into a queue of that size;
- pass: `plan(snapshot, now)` with nothing changed (every GPU busy, the head blocked: reservation,
  backfill scan and preemption check all run);
- completion: `plan` after one running job ended (charge, start the next job by fairness);
- pass/snap: the same idle pass in snapshot mode (plan diffs snapshot.pending: O(pending)).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpusched.core.scheduler import Scheduler, Snapshot, StartJob
from gpusched.gpu.backend import Gpu
from gpusched.model import Job, JobSpec, JobState, WholeRequest


def _gpus(n: int) -> tuple[Gpu, ...]:
    return tuple(Gpu(index=i, uuid=f"GPU-{i:04d}", name="NVIDIA H100 80GB HBM3", model="H100-80GB",
                     memory_total_mib=81559, sm_count=132, mig_enabled=False, mig_pending=False,
                     numa_node=i // 4) for i in range(n))


def _jobs(n: int, users: int, seed: int, start_id: int = 1) -> list[Job]:
    r = random.Random(seed)
    specs = [JobSpec(argv=["x"], cwd="/", request=WholeRequest(gpus=g), time_limit_s=t)
             for g in (1, 2) for t in (None, 3600.0)]
    return [Job(id=start_id + k, uid=1000 + (u := r.randrange(users)), gid=1, user=f"u{u}",
                spec=specs[r.randrange(len(specs))], state=JobState.PENDING, submitted_at=float(k))
            for k in range(n)]


def _time(fn: Callable[[], object], reps: int) -> float:
    """Mean microseconds per call of fn over reps calls."""
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6


def _median_us(fn: Callable[[], object], reps: int) -> float:
    """Median microseconds of one call of fn over reps calls, each timed alone (issue 11 states its
    goal for the pass as a median: a stray collection or a preempted slice moves the mean, not it)."""
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def measure(pending: int, users: int, reps: int) -> dict[str, float]:
    # Start from a clean heap: the previous size's garbage (100k jobs) is otherwise collected by a
    # full GC pass that lands inside whichever timed loop triggers it (one row read 60x too slow).
    gc.collect()
    gpus = _gpus(8)
    sched = Scheduler(incremental=True)
    jobs = _jobs(pending + 64, users, seed=pending + users)
    for j in jobs[:pending]:
        sched.submit(j)
    extra = iter(jobs[pending:])
    t0 = time.perf_counter()
    n_sub = 0
    for j in extra:  # submit cost at this queue size
        sched.submit(j)
        n_sub += 1
    submit_us = (time.perf_counter() - t0) / n_sub * 1e6

    now = 10.0
    active: dict[int, Job] = {}
    by_id = {j.id: j for j in jobs}

    def snapshot() -> Snapshot:
        return Snapshot(gpus=gpus, pending=(), active=tuple(active.values()))

    def apply(actions: Sequence[object]) -> None:
        for a in actions:
            if isinstance(a, StartJob):
                active[a.job_id] = by_id[a.job_id].model_copy(update={
                    "state": JobState.RUNNING, "started_at": now, "allocation": a.allocation})

    apply(sched.plan(snapshot(), now))  # fill the node
    snap = snapshot()
    idle_us = _time(lambda: sched.plan(snap, now), reps)
    idle_p50_us = _median_us(lambda: sched.plan(snap, now), reps)

    def complete_one() -> None:
        nonlocal now
        now += 1.0
        victim = next(iter(active))
        del active[victim]
        apply(sched.plan(snapshot(), now))

    done_us = _time(complete_one, reps)

    # snapshot mode: the same idle pass, but plan diffs the full pending tuple each time
    snap_sched = Scheduler()
    # two equal but distinct tuples, alternated, so plan's identity fast path never applies
    pends = [tuple(jobs[:pending]), tuple(list(jobs[:pending]))]
    snap_sched.plan(Snapshot(gpus=gpus, pending=pends[0], active=()), now)
    snap_reps = max(3, reps // 10)
    calls = iter(range(10**9))
    snap_us = _time(lambda: snap_sched.plan(Snapshot(gpus=gpus, pending=pends[next(calls) % 2], active=()), now),
                    snap_reps)
    return {"submit": submit_us, "pass": idle_us, "pass p50": idle_p50_us, "completion": done_us,
            "pass/snap": snap_us}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny smoke version")
    args = ap.parse_args(argv)
    sizes = (200, 2_000) if args.quick else (1_000, 10_000, 100_000)
    user_counts = (20,) if args.quick else (100, 1_000)
    reps = 20 if args.quick else 200
    ops = ("submit", "pass", "pass p50", "completion", "pass/snap")
    print(f"{'pending':>8} {'users':>6} " + " ".join(f"{o + ' us':>14}" for o in ops))
    for users in user_counts:
        rows = {}
        for n in sizes:
            rows[n] = measure(n, users, reps)
            print(f"{n:>8} {users:>6} " + " ".join(f"{rows[n][o]:>14.1f}" for o in ops), flush=True)
        lo, hi = sizes[0], sizes[-1]
        ratios = " ".join(f"{o}={rows[hi][o] / rows[lo][o]:.2f}x" for o in ops)
        print(f"  growth {lo} -> {hi} pending ({hi // lo}x more), {users} users: {ratios}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
