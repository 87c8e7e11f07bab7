"""Soak: hours of mixed submit / cancel / complete / query traffic; the daemon must not grow.

Runs the real `gpuschedd` on 8 simulated GPUs and keeps it busy for `--duration` seconds (default
an hour) from a few client threads: short jobs that complete, jobs that are cancelled while pending
or running, and queue/show/logs/stats queries. Every `--sample` seconds it records the daemon's RSS
(VmRSS) and open file descriptors (/proc/PID/fd); the traffic keeps at most 40 jobs unfinished, so
the daemon is in a steady state. At the end it prints the series and compares the
last quarter with the first (after a warm-up): RSS may not grow by more than 20% and the fd count by
more than 8. Exit 0 when it did not grow, 1 when it did. Not part of CI (`--quick` is a 20 s smoke).

    .venv/bin/python bench/soak.py                  # an hour
    .venv/bin/python bench/soak.py --duration 600   # ten minutes
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field

import harness

from gpusched.protocol import (
    CancelRequest,
    CancelResult,
    LogsRequest,
    LogsResult,
    ProtocolError,
    QueueRequest,
    QueueResult,
    ShowRequest,
    ShowResult,
    StatsRequest,
    StatsResult,
)
from gpusched_cli.client import Client

RSS_GROWTH_LIMIT = 0.20
MAX_UNFINISHED = 40  # pending + running jobs the traffic keeps at most
FD_GROWTH_LIMIT = 8


@dataclass
class Counters:
    submitted: int = 0
    cancelled: int = 0
    queries: int = 0
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, name: str, n: int = 1) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + n)


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def traffic(socket_path: str, seed: int, stop: threading.Event, counters: Counters) -> None:
    """One client's mix: mostly short jobs, some cancels, many queries."""
    rng = random.Random(seed)
    mine: list[int] = []
    with Client(socket_path) as c:
        while not stop.is_set():
            roll = rng.random()
            try:
                if roll < 0.35:
                    # Keep the queue bounded: a soak measures a steady state, not a growing backlog.
                    if c.call(QueueRequest(limit=1), QueueResult).total >= MAX_UNFINISHED:
                        counters.add("queries")
                        continue
                    argv = ["true"] if rng.random() < 0.7 else ["sleep", f"{rng.uniform(0.1, 2.0):.2f}"]
                    mine.append(harness.submit_one(c, harness.spec(argv, gpus=rng.choice((1, 1, 1, 2)))))
                    counters.add("submitted")
                elif roll < 0.45 and mine:
                    victim = mine.pop(rng.randrange(len(mine)))
                    c.call(CancelRequest(job_ids=[victim]), CancelResult)
                    counters.add("cancelled")
                elif roll < 0.70:
                    c.call(QueueRequest(all=rng.random() < 0.2, limit=200), QueueResult)
                    counters.add("queries")
                elif roll < 0.90 and mine:
                    job_id = rng.choice(mine)
                    c.call(ShowRequest(job_id=job_id), ShowResult)
                    c.call(LogsRequest(job_id=job_id), LogsResult)
                    counters.add("queries", 2)
                else:
                    c.call(StatsRequest(since_s=60), StatsResult)  # a window that fills early in the run
                    counters.add("queries")
            except ProtocolError as exc:
                counters.errors.append(f"{exc.code}: {exc.message}")
            finally:
                del mine[:-200]  # keep cancel targets recent, and the list bounded
                stop.wait(rng.uniform(0.0, 0.02))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=3600.0, help="seconds of traffic (default 3600)")
    parser.add_argument("--sample", type=float, default=30.0, help="seconds between samples (default 30)")
    parser.add_argument("--clients", type=int, default=4, help="client threads (default 4)")
    parser.add_argument("--quick", action="store_true", help="20 s with 2 s samples (smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.duration, args.sample = 20.0, 2.0
    # SIGTERM (a timeout, a `kill`) must still clean up the daemon and its jobs in `finally`.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    daemon = harness.DaemonProc(harness.short_tmpdir("gssoak-"))
    try:
        daemon.start()
        stop = threading.Event()
        counters = Counters()
        threads = [threading.Thread(target=traffic, args=(daemon.socket, i, stop, counters), daemon=True)
                   for i in range(args.clients)]
        for t in threads:
            t.start()
        samples: list[tuple[float, int, int]] = []
        t0 = time.monotonic()
        while (elapsed := time.monotonic() - t0) < args.duration:
            samples.append((elapsed, rss_kib(daemon.pid), open_fds(daemon.pid)))
            print(f"t={elapsed:7.0f}s  rss={samples[-1][1] / 1024:7.1f} MiB  fds={samples[-1][2]:4d}  "
                  f"submitted={counters.submitted} cancelled={counters.cancelled} queries={counters.queries}",
                  flush=True)
            time.sleep(min(args.sample, max(0.0, args.duration - elapsed)))
        stop.set()
        for t in threads:
            t.join(30)
        code = verdict(samples, counters)
        return 0 if args.quick else code  # 20 s cannot tell warm-up from growth: report only
    finally:
        daemon.cleanup()


def verdict(samples: list[tuple[float, int, int]], counters: Counters) -> int:
    """Compare the last quarter of the run with the first quarter after a warm-up tenth."""
    if len(samples) < 8:
        print("too few samples to judge growth; run longer", file=sys.stderr)
        return 1
    body = samples[len(samples) // 10:]
    quarter = max(2, len(body) // 4)
    first, last = body[:quarter], body[-quarter:]
    rss_first, rss_last = statistics.median(s[1] for s in first), statistics.median(s[1] for s in last)
    fd_first, fd_last = statistics.median(s[2] for s in first), statistics.median(s[2] for s in last)
    growth = (rss_last - rss_first) / rss_first
    print(f"\nsubmitted {counters.submitted}, cancelled {counters.cancelled}, queries {counters.queries}, "
          f"refused {len(counters.errors)}")
    print(f"RSS  first quarter {rss_first / 1024:.1f} MiB -> last quarter {rss_last / 1024:.1f} MiB "
          f"({growth:+.1%}; limit +{RSS_GROWTH_LIMIT:.0%})")
    print(f"fds  first quarter {fd_first:.0f} -> last quarter {fd_last:.0f} ({fd_last - fd_first:+.0f}; "
          f"limit +{FD_GROWTH_LIMIT})")
    grew = growth > RSS_GROWTH_LIMIT or fd_last - fd_first > FD_GROWTH_LIMIT
    print("verdict: " + ("GREW" if grew else "steady"))
    return 1 if grew else 0


if __name__ == "__main__":
    sys.exit(main())
