"""Crash storm: submit from several threads, `kill -9` the daemon at random times, restart, check.

For each seed: a fresh real `gpuschedd` on simulated GPUs; THREADS client threads submit M jobs in
all (each named uniquely, each appending one line to its own marker file when it runs, then exiting
0); a killer `kill -9`s the daemon at random moments (every KILL_MIN..KILL_MAX s) and restarts it at
once, until every job has ended (so kills land while jobs are submitted, launched and reaped).
Then:

- the daemon started again after every kill, and served (a submit answered) right after;
- every acknowledged submission is stored exactly once (by its unique name); one whose answer was
  lost in the crash is stored at most once; nothing else is stored;
- every job ran at most once (one marker line), and every stored job ended COMPLETED with one
  marker line: none is LOST, FAILED or stuck.

The script stops by itself (every wait has a deadline), and leaves nothing behind: the daemon, the
jobs and the temp folder are removed at the end, on failure, on Ctrl-C and on SIGTERM.

    .venv/bin/python bench/crash_storm.py --seeds 10 --submissions 5000
    .venv/bin/python bench/crash_storm.py --quick        # 2 seeds x 150, for the smoke test

Exit status 0 when every seed passed, 1 otherwise; the table lists each seed's figures.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import harness
from harness import DaemonProc, Table, machine_line, short_tmpdir, wait_until

from gpusched.model import JobSpec, JobState, WholeRequest
from gpusched.protocol import ProtocolError, QueueRequest, QueueResult, SubmitRequest
from gpusched_cli.client import Client, DaemonUnavailable

THREADS = 4
CONFIG = "kill_grace_s = 2.0\ntick_s = 0.2\n"


@dataclass
class Ledger:
    """What the clients know for certain (guarded by `lock`)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    acked: dict[str, int] = field(default_factory=dict)  # name -> job id from the answer
    unknown: set[str] = field(default_factory=set)  # sent; the answer was lost in a crash
    kills: int = 0
    restart_s: list[float] = field(default_factory=list)  # kill -> socket answers again
    serve_s: list[float] = field(default_factory=list)  # kill -> a submit answered
    errors: list[str] = field(default_factory=list)


def job_spec(name: str, marker_dir: str) -> JobSpec:
    # `sh -c '...' MARKER`: $0 is the marker path; one line per time the job actually ran.
    return JobSpec(argv=["sh", "-c", 'echo ran >> "$0"', os.path.join(marker_dir, name)], cwd="/",
                   env=dict(harness.JOB_ENV), request=WholeRequest(gpus=1), name=name)


class Connection:
    """A client connection that survives daemon crashes: `call` is None when the answer was lost."""

    def __init__(self, path: str, deadline: float) -> None:
        self.path, self.deadline = path, deadline
        self.client: Client | None = None

    def call(self, message: dict[str, Any]) -> dict[str, Any] | None:
        while self.client is None:
            c = Client(self.path, timeout=30)
            try:
                c.connect()
                self.client = c
            except (DaemonUnavailable, ProtocolError, OSError):
                c.close()
                if time.monotonic() > self.deadline:
                    raise TimeoutError("the daemon did not come back") from None
                time.sleep(0.02)
        try:
            reply: dict[str, Any] = self.client.raw_call(message)
            return reply
        except (DaemonUnavailable, OSError):
            self.client.close()
            self.client = None
            return None

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


def storm(seed: int, daemon: DaemonProc, marker_dir: str, submissions: int, kill_range: tuple[float, float],
          deadline: float) -> Ledger:
    ledger = Ledger()
    done = threading.Event()

    def client(t: int) -> None:
        conn = Connection(daemon.socket, deadline)
        try:
            for i in range(submissions // THREADS + (t < submissions % THREADS)):
                name = f"s{seed}-t{t}-{i}"
                reply = conn.call(SubmitRequest(spec=job_spec(name, marker_dir)).model_dump(mode="json"))
                with ledger.lock:
                    if reply is None:
                        ledger.unknown.add(name)
                    elif reply.get("ok"):
                        ledger.acked[name] = reply["result"]["job_id"]
                    else:
                        ledger.errors.append(f"{name}: refused: {reply.get('error')}")
        except Exception as exc:
            with ledger.lock:
                ledger.errors.append(f"client {t}: {exc!r}")
        finally:
            conn.close()

    def killer() -> None:
        rng = random.Random(f"{seed}-killer")
        try:
            while not done.wait(rng.uniform(*kill_range)):
                daemon.proc.kill()  # type: ignore[union-attr]
                daemon.proc.wait(10)  # type: ignore[union-attr]
                killed = time.monotonic()
                ledger.kills += 1
                ledger.restart_s.append(daemon.start(timeout=60))
                with Client(daemon.socket, timeout=30) as c:  # it serves: a submit is answered
                    c.call(QueueRequest(limit=1), QueueResult)
                ledger.serve_s.append(time.monotonic() - killed)
        except Exception as exc:
            with ledger.lock:
                ledger.errors.append(f"restart after kill {ledger.kills}: {exc!r}: {daemon.log_tail()[-800:]}")

    def drained() -> bool:
        """Every job ended (checked between kills, so kills also land while jobs launch and exit)."""
        try:
            with Client(daemon.socket, timeout=30) as c:
                return not c.call(QueueRequest(limit=1), QueueResult).jobs
        except (DaemonUnavailable, ProtocolError, OSError):
            return False

    threads = [threading.Thread(target=client, args=(t,), daemon=True) for t in range(THREADS)]
    kill_thread = threading.Thread(target=killer, daemon=True)
    kill_thread.start()
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(1.0, deadline - time.monotonic()))
        while not drained() and time.monotonic() < deadline and kill_thread.is_alive():
            time.sleep(0.5)
    finally:
        done.set()  # the killer must not restart a daemon after the clean-up killed it
        kill_thread.join(90)
    if any(t.is_alive() for t in threads) or kill_thread.is_alive():
        ledger.errors.append("a client or the killer did not finish before the deadline")
    return ledger


def all_jobs(c: Client) -> list[Any]:
    rows: list[Any] = []
    while True:
        page = c.call(QueueRequest(all=True, after_id=rows[-1].id if rows else 0, limit=3000), QueueResult).jobs
        if not page:
            return rows
        rows += page


def check(ledger: Ledger, jobs: list[Any], marker_dir: str) -> tuple[dict[str, int], list[str]]:
    problems = list(ledger.errors)
    by_name: dict[str, list[Any]] = {}
    for job in jobs:
        by_name.setdefault(job.name or "", []).append(job)
    for name, job_id in ledger.acked.items():
        found = [j.id for j in by_name.get(name, [])]
        if found != [job_id]:
            problems.append(f"acknowledged {name} (job {job_id}) stored as {found}")
    for name in ledger.unknown:
        if len(by_name.get(name, [])) > 1:
            problems.append(f"{name} (answer lost in a crash) stored {len(by_name[name])} times")
    for name in by_name.keys() - ledger.acked.keys() - ledger.unknown:
        problems.append(f"job {name!r} stored but never submitted")
    states: dict[str, int] = {}
    for job in jobs:
        states[job.state.value] = states.get(job.state.value, 0) + 1
        try:
            with open(os.path.join(marker_dir, job.name or "")) as f:
                runs = len(f.read().splitlines())
        except FileNotFoundError:
            runs = 0
        if runs > 1:
            problems.append(f"job {job.id} ({job.name}) ran {runs} times")
        if job.state is not JobState.COMPLETED or runs != 1:
            problems.append(f"job {job.id} ({job.name}) ended {job.state} after {runs} run(s)")
    return states, problems


@contextmanager
def terminated_on_sigterm() -> Iterator[None]:
    """SIGTERM cleans up like Ctrl-C does."""
    def raise_interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_seed(seed: int, args: argparse.Namespace, table: Table) -> bool:
    base = short_tmpdir("gs-storm-")
    marker_dir = os.path.join(base, "markers")
    os.makedirs(marker_dir)
    os.chmod(base, 0o755)
    os.chmod(marker_dir, 0o777)  # jobs run as their submitter; when that is not root it must write here
    daemon = DaemonProc(base, sim=f"H100-80GB:{args.gpus}", extra_config=CONFIG)
    began = time.monotonic()
    deadline = began + args.seed_timeout
    try:
        daemon.start()
        ledger = storm(seed, daemon, marker_dir, args.submissions, (args.kill_min, args.kill_max), deadline)
        jobs: list[Any] = []
        try:
            if daemon.proc is None or daemon.proc.poll() is not None:  # the killer's last restart failed
                daemon.start()
            with Client(daemon.socket, timeout=30) as c:
                try:
                    wait_until(lambda: not c.call(QueueRequest(), QueueResult).jobs,
                               timeout=max(5.0, deadline - time.monotonic()), interval=0.2, what="every job to end")
                except TimeoutError as exc:
                    ledger.errors.append(str(exc))
                jobs = all_jobs(c)
        except Exception as exc:
            ledger.errors.append(f"after the storm the daemon does not serve: {exc!r}: {daemon.log_tail()[-800:]}")
        states, problems = check(ledger, jobs, marker_dir)
        stop_s = daemon.terminate() if daemon.proc is not None and daemon.proc.poll() is None else float("nan")
        elapsed = time.monotonic() - began
        table.add(seed, len(ledger.acked), len(ledger.unknown), sum(1 for n in ledger.unknown if any(
            j.name == n for j in jobs)), ledger.kills, max(ledger.restart_s, default=float("nan")),
            max(ledger.serve_s, default=float("nan")), len(jobs), ",".join(f"{k}:{v}" for k, v in sorted(
                states.items())), len(problems), stop_s, elapsed)
        for line in problems[:20]:
            print(f"  seed {seed}: {line}", file=sys.stderr)
        return not problems
    finally:
        daemon.cleanup()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10, help="number of seeds (1..N)")
    parser.add_argument("--first-seed", type=int, default=1)
    parser.add_argument("--submissions", type=int, default=5000, help="submissions per seed")
    parser.add_argument("--gpus", type=int, default=8, help="simulated GPUs")
    parser.add_argument("--kill-min", type=float, default=3.0, help="seconds between kills, at least")
    parser.add_argument("--kill-max", type=float, default=6.0, help="seconds between kills, at most")
    parser.add_argument("--seed-timeout", type=float, default=1800.0, help="give up on a seed after this long")
    parser.add_argument("--quick", action="store_true", help="2 seeds x 150 submissions, kills every 0.5-1.5 s")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.submissions, args.kill_min, args.kill_max, args.seed_timeout = 2, 150, 0.5, 1.5, 100.0
    print(machine_line())
    print(f"crash storm: {args.seeds} seed(s) x {args.submissions} submissions from {THREADS} threads, "
          f"kill -9 every {args.kill_min:g}-{args.kill_max:g} s, {args.gpus} simulated GPUs")
    table = Table(["seed", "acked", "answer lost", "of those stored", "kill -9", "max restart s",
                   "max kill->serving s", "jobs stored", "final states", "problems", "SIGTERM stop s", "seed s"])
    ok = True
    with terminated_on_sigterm():
        try:
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                ok = run_seed(seed, args, table) and ok
                print(table.render().splitlines()[-1], flush=True)
        except KeyboardInterrupt:
            print("interrupted; cleaned up", file=sys.stderr)
            ok = False
    print()
    print(table.render())
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
