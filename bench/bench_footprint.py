"""Daemon footprint with a deep queue: RSS, idle CPU and restart time, against the empty daemon.

A node can collect a very long queue (a parameter sweep submitted in one go). Nothing about a
pending job needs CPU, so an idle daemon should stay idle and small however many jobs wait, and
a restart should not keep users waiting. Baseline: the same daemon with nothing queued, measured
in the same run. Jobs wait behind a blocker (`sleep 3600` holding all 8 GPUs), so they stay PENDING.

    python bench/bench_footprint.py            # 10k and 100k queued jobs (long: see docs/benchmarks.md)
    python bench/bench_footprint.py --quick    # 1k and 2k, short idle windows (CI smoke)
    python bench/bench_footprint.py --sizes 100000 --distinct --env-kib 6   # a sweep from a module-laden shell

Jobs carry a 3-variable environment unless `--env-kib` gives them one of that size (users' shells
with modules or conda hold 5-10 KiB): the database's size is printed beside the figures.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import harness as h

from gpusched.protocol import (
    ProtocolError,
    QueueRequest,
    QueueResult,
    WaitRequest,
    WaitResult,
)
from gpusched_cli.client import Client, DaemonUnavailable


@dataclass
class Footprint:
    """What one queue depth costs."""

    queued: int
    rss_mib: float
    idle_cpu_pct: float
    stop_s: float
    start_to_ready_s: float
    rss_after_restart_mib: float
    queue_request: str
    jobs_at_first_answer: int  # unfinished jobs visible right after the restarted socket first answered
    database_mib: float  # gpusched.db and its WAL, after the restart


def job_count(socket_path: str) -> int:
    """Unfinished jobs the daemon reports: `queue`'s `total` (its rows are capped to fit one frame)."""
    with Client(socket_path, timeout=120) as c:
        return c.call(QueueRequest(limit=1), QueueResult).total


def try_queue(socket_path: str, expected: int) -> str:
    """What a plain `gpusched queue` gets at this depth: rows listed and the total it reports."""
    try:
        with Client(socket_path, timeout=120) as c:
            t0 = time.perf_counter()
            result = c.call(QueueRequest(), QueueResult)
            ms = 1000 * (time.perf_counter() - t0)
    except (ProtocolError, DaemonUnavailable) as exc:
        return f"FAILS ({type(exc).__name__}: {exc})"
    verdict = "ok" if result.total == expected else f"total {result.total} != {expected}"
    return f"{verdict}: {len(result.jobs)} rows in {ms:.0f} ms"


def restart(d: h.DaemonProc, expected: int) -> tuple[float, float, int]:
    """SIGTERM, start again, and wait until the daemon answers with every job loaded.

    Returns (seconds to exit after SIGTERM, seconds from spawn until `expected` jobs are visible,
    jobs visible on the first request after the socket answered: the socket opens before recovery).
    """
    stop_s = d.terminate()
    t0 = time.perf_counter()
    d.start(timeout=600)
    first = job_count(d.socket)
    h.wait_until(lambda: job_count(d.socket) == expected, timeout=600, interval=0.005,
                 what=f"{expected} jobs after restart")
    return stop_s, time.perf_counter() - t0, first


def settle(d: h.DaemonProc, quiet_s: float) -> None:
    """Let the submit burst's last scheduling passes finish before an idle window starts."""
    time.sleep(quiet_s)


def measure(d: h.DaemonProc, queued: int, window_s: float) -> Footprint:
    expected = queued + (1 if queued else 0)  # + the blocker, which is running
    settle(d, min(2.0, window_s / 2))
    rss = h.rss_mib(d.pid)
    idle = h.idle_cpu_percent(d.pid, window_s)
    queue_ok = try_queue(d.socket, expected)
    stop_s, ready_s, first = restart(d, expected)
    settle(d, min(2.0, window_s / 2))
    result = Footprint(queued, rss, idle, stop_s, ready_s, h.rss_mib(d.pid), queue_ok, first, database_mib(d))
    print(f"  measured {result}", flush=True)  # a long run that is cut short still leaves its figures
    return result


def database_mib(d: h.DaemonProc) -> float:
    path = os.path.join(d.state_dir, "gpusched.db")
    return sum(os.path.getsize(p) for p in (path, path + "-wal") if os.path.exists(p)) / 2**20


def fill(d: h.DaemonProc, target: int, have: int, clients: int, steps: int, distinct: bool = False,
         env: dict[str, str] | None = None) -> None:
    """Submit up to `target` pending jobs in `steps` chunks, printing the rate of each chunk.

    The rate per chunk shows whether submitting gets slower as the queue grows. With `distinct`
    every job has its own argv (`true 17`), as in a sweep submitted job by job, so nothing but the
    environment and the request can be shared; otherwise all are the same spec, as an array's tasks.
    Each submit carries a request_id as `gpusched submit`'s do, so the database holds their keys too.
    """
    same = h.spec(["true"], gpus=1, env=env)
    chunk = max(1, (target - have + steps - 1) // steps)
    while have < target:
        n = min(chunk, target - have)
        job = (lambda k, base=have: h.spec(["true", str(base + k)], gpus=1, env=env)) if distinct else same
        elapsed, _ = h.submit_concurrently(d.socket, job, n, clients, request_ids=True)
        have += n
        print(f"  queued {have:>7}: last {n} submits at {n / elapsed:7.0f}/s ({elapsed:.1f} s)", flush=True)


def start_blocker(d: h.DaemonProc) -> int:
    """One running job that holds all 8 GPUs, so every job submitted after it stays PENDING."""
    with Client(d.socket) as c:
        job_id = h.submit_one(c, h.spec(["sleep", "3600"], gpus=8))
        h.wait_until(lambda: c.call(WaitRequest(job_id=job_id, timeout_s=0), WaitResult).job.state == "RUNNING",
                     timeout=30, what="blocker running")
    return job_id


def print_results(results: list[Footprint]) -> None:
    base = results[0]
    table = h.Table(["queued jobs", "RSS MiB", "x empty", "RSS after restart", "idle CPU %", "x empty",
                     "SIGTERM->exit s", "spawn->all jobs s", "x empty", "queue request",
                     "jobs seen at 1st answer", "database MiB"])
    for r in results:
        table.add(r.queued, r.rss_mib, r.rss_mib / base.rss_mib, r.rss_after_restart_mib, r.idle_cpu_pct,
                  ratio(r.idle_cpu_pct, base.idle_cpu_pct), r.stop_s, r.start_to_ready_s,
                  r.start_to_ready_s / base.start_to_ready_s, r.queue_request, r.jobs_at_first_answer,
                  r.database_mib)
    print(table.render())
    print()
    for r in results[1:]:
        print(f"ratio vs empty @ {r.queued} queued: RSS x{r.rss_mib / base.rss_mib:.2f}, "
              f"idle CPU {r.idle_cpu_pct:.2f}% vs {base.idle_cpu_pct:.2f}% "
              f"({ratio(r.idle_cpu_pct, base.idle_cpu_pct)}), "
              f"restart x{r.start_to_ready_s / base.start_to_ready_s:.2f}, "
              f"RSS per queued job {1024 * (r.rss_mib - base.rss_mib) / r.queued:.1f} KiB")


def ratio(value: float, base: float) -> str:
    """Idle CPU of an empty daemon can round to zero; say so instead of dividing by it."""
    return f"x{value / base:.1f}" if base > 0.01 else "n/a (empty ~0)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CI smoke: 1k and 2k jobs, 1 s idle window")
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=None,
                        help="queue depths to measure, comma-separated (default 10000,100000)")
    parser.add_argument("--window", type=float, default=None, help="idle CPU window in seconds (default 5)")
    parser.add_argument("--clients", type=int, default=16, help="concurrent submitting connections")
    parser.add_argument("--env-kib", type=int, default=0,
                        help="give every job an environment of about this many KiB (default: 3 short variables)")
    parser.add_argument("--distinct", action="store_true",
                        help="every job its own argv (a sweep submitted job by job), not one spec for all")
    args = parser.parse_args()
    sizes = args.sizes or ([1000, 2000] if args.quick else [10_000, 100_000])
    window = args.window or (1.0 if args.quick else 5.0)

    print(h.machine_line())
    print(f"daemon: gpuschedd --sim {h.SIM}; idle window {window:g} s; fill with {args.clients} clients; "
          f"{'a distinct argv per job' if args.distinct else 'one spec for every job'}; "
          f"{f'a {args.env_kib} KiB environment' if args.env_kib else 'a 3-variable environment'}")
    env = h.module_env(args.env_kib) if args.env_kib else None
    d = h.DaemonProc(h.short_tmpdir("gbf-"))
    try:
        d.start()
        results = [measure(d, 0, window)]
        start_blocker(d)
        have = 0
        for size in sorted(sizes):
            fill(d, size, have, args.clients, steps=2 if args.quick else 10, distinct=args.distinct, env=env)
            have = size
            results.append(measure(d, size, window))
        print()
        print_results(results)
        return 0
    finally:
        cleanup(d)


def cleanup(d: h.DaemonProc) -> None:
    """Stop the blocker through the daemon if it still answers, then kill whatever is left."""
    try:
        if d.proc is not None and d.proc.poll() is None:
            with Client(d.socket, timeout=30) as c:
                h.cancel_all(c, [1])  # the blocker is always job 1 on a fresh state dir
    except Exception as exc:  # cleanup must go on: the kill below catches the rest
        print(f"note: cancelling the blocker failed: {exc}", file=sys.stderr)
    d.cleanup()


if __name__ == "__main__":
    sys.exit(main())
