"""Submit path cost: throughput over the socket, submit->start latency, arrays, and the CLI's process time.

Every ack means the job is committed to SQLite with synchronous=FULL. The baseline for throughput
is the single-commit floor, measured in the same run on the same disk: one INSERT + COMMIT (one
fsync) per job, WAL, synchronous=FULL; it is measured right before and right after the throughput
phases (the disk is shared, and its fsync time drifts) and their mean is the baseline. Group commit
(gpusched/daemon/groupcommit.py) lets concurrent submits share one COMMIT, so with many clients
the daemon can beat that floor: the printed ratio is submits/s / floor (the goal is >= 2 with 16
clients). The clients send what `gpusched submit` sends, a request_id included, on plain sockets and
read the answers as its C front does (harness.send_submits_concurrently): on 2 cores their CPU is
taken from the daemon's, and a client building pydantic models used 60-110 us of it per submit,
several times what the real client does. Arrays: the time until `--array 1-10000` is acknowledged
(one request, one transaction, durable), over the socket and as a whole `gpusched submit` process.
Beside each throughput phase the same clients drive bench/bare_server.py, the least a durable Python
submit server can do (frames, one INSERT each, one COMMIT per turn of its loop, no validation, no
scheduler), on the same disk, and the same with `--checked` (gpusched's own request validation and
request_id key added): their rates are the ceiling for a Python daemon on this machine, and
gpusched's rate is also printed as a fraction of each. Before them the same clients drive
bench/single_commit_daemon.py, gpuschedd with one write per COMMIT, on the same disk: gpusched's rate
as a multiple of that one is group commit's own gain, which the floor (no daemon CPU in it) cannot show.
The CLI's baseline is `python -c pass`: the part of `gpusched submit` that no client code can
remove. The baseline for submit->RUNNING is the same daemon with `launcher = "spawn"` (a Python
interpreter started per job's shim, as before the fork server), sampled alternately with the
default `launcher = "forkserver"` in the same run.

    python bench/bench_api.py            # full run (~1 min on 2 cores)
    python bench/bench_api.py --quick    # CI smoke (a few seconds)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sqlite3
import sys
import time
from dataclasses import dataclass

import harness as h

from gpusched.model import JobState
from gpusched.protocol import (
    CancelRequest,
    CancelResult,
    QueueRequest,
    QueueResult,
    SubmitRequest,
    SubmitResult,
    WaitRequest,
    WaitResult,
    encode_frame,
)
from gpusched_cli.client import Client
from gpusched_cli.resubmit import new_request_id


@dataclass
class Sizes:
    """How much work each phase does; --quick shrinks everything for the CI smoke."""

    submits: int  # per throughput phase
    latency_samples: int
    cli_runs: int
    clients: tuple[int, ...] = (1, 16, 64)
    array_tasks: int = 10000
    array_runs: int = 3


FULL = Sizes(submits=3000, latency_samples=200, cli_runs=30)
QUICK = Sizes(submits=300, latency_samples=20, cli_runs=4, array_tasks=1000, array_runs=1)


def sqlite_floor(directory: str, n: int) -> float:
    """Durable commits per second: one INSERT + COMMIT each, WAL, synchronous=FULL, on `directory`'s disk.

    The row holds the same spec JSON the daemon stores, so the write size matches.
    """
    path = os.path.join(directory, "floor.db")
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("CREATE TABLE jobs (id INTEGER PRIMARY KEY AUTOINCREMENT, spec TEXT NOT NULL, at REAL NOT NULL)")
        row = h.spec(["true"]).model_dump_json()
        t0 = time.perf_counter()
        for _ in range(n):
            db.execute("BEGIN IMMEDIATE")
            db.execute("INSERT INTO jobs (spec, at) VALUES (?, ?)", (row, time.time()))
            db.execute("COMMIT")
        return n / (time.perf_counter() - t0)
    finally:
        db.close()
        h.remove_database(path)


@dataclass
class Phase:
    rate: float  # submits/s
    cpu_us: float  # the daemon's CPU per submit
    client_cpu_us: float  # this process's (the client threads') CPU per submit
    per_fsync: float  # submits per COMMIT, from the daemon's own counters


@dataclass
class Throughput:
    phases: dict[int, Phase]  # gpuschedd's, per client count
    # gpuschedd committing each submit alone (bench/single_commit_daemon.py), per client count, the same
    # clients right after gpusched's phase
    single: dict[int, Phase]
    # bench/bare_server.py, plain and --checked: (submits/s, its CPU us per submit) per client count,
    # the same clients right after gpusched's phase
    ceilings: dict[str, dict[int, tuple[float, float]]]


_KEY = "0" * 32
_SUBMIT = encode_frame(SubmitRequest(spec=h.spec(["true"], gpus=1), request_id=_KEY).model_dump(mode="json"))


def submit_frame() -> bytes:
    """A submit of `true` on 1 GPU as `gpusched submit` sends it: with a request_id made as the CLI
    makes them (each submit its own). Built as the C front builds its frame, bytes around the key."""
    return _SUBMIT.replace(_KEY.encode(), new_request_id().encode(), 1)


def daemon_phase(d: h.DaemonProc, submits: int, clients: int) -> Phase:
    """`submits` sent by `clients` threads to the daemon `d` (started with h.METRICS), each job
    cancelled afterwards (outside the CPU reading) so the next phase starts with an empty queue."""
    commits = d.metrics_counter("gpusched_group_commits_total")
    writes = d.metrics_counter("gpusched_group_commit_writes_total")
    before, own_before = h.cpu_seconds(d.pid), h.cpu_seconds(os.getpid())
    elapsed, ids = h.send_submits_concurrently(d.socket, submit_frame, submits, clients)
    phase = Phase(rate=submits / elapsed, cpu_us=1e6 * (h.cpu_seconds(d.pid) - before) / submits,
                  client_cpu_us=1e6 * (h.cpu_seconds(os.getpid()) - own_before) / submits,
                  per_fsync=((d.metrics_counter("gpusched_group_commit_writes_total") - writes)
                             / (d.metrics_counter("gpusched_group_commits_total") - commits)))
    with Client(d.socket, timeout=120) as c:
        h.cancel_all(c, ids)
    return phase


def throughput(d: h.DaemonProc, single: h.DaemonProc, ceilings: dict[str, h.BareServer], sizes: Sizes) -> Throughput:
    """Submits/s per client count (each client a thread sending `submit_frame()` on its own socket
    and reading the answer, one in flight, as `gpusched submit` does), the daemon's CPU per submit in
    microseconds (utime+stime over the phase: what the ratio to the floor is made of when the daemon
    is the busy side), this process's CPU per submit (the client threads: on 2 cores they and the
    daemon share the machine), and submits per COMMIT from the daemon's own counters (group commit at
    work). Jobs queue behind a blocker, so no job process competes for CPU. After each phase the same
    clients drive `single` (gpuschedd committing each submit alone, with its own blocker: group
    commit's baseline), then each of `ceilings` (bench/bare_server.py)."""
    out = Throughput({}, {}, {name: {} for name in ceilings})
    for clients in sizes.clients:
        out.phases[clients] = daemon_phase(d, sizes.submits, clients)
        out.single[clients] = daemon_phase(single, sizes.submits, clients)
        for name, bare in ceilings.items():
            before = h.cpu_seconds(bare.pid)
            elapsed, _ = h.send_submits_concurrently(bare.socket, submit_frame, sizes.submits, clients)
            out.ceilings[name][clients] = (sizes.submits / elapsed,
                                           1e6 * (h.cpu_seconds(bare.pid) - before) / sizes.submits)
    return out


@dataclass
class ArrayTimes:
    ack: list[float]  # SubmitRequest(array="1-N") sent -> answer received (committed)
    cli: list[float]  # `gpusched submit --array 1-N -- true`, the whole process
    cancel: list[float]  # CancelRequest(array id) -> answer (every task CANCELLED, one COMMIT)


def arrays(d: h.DaemonProc, sizes: Sizes) -> ArrayTimes:
    """Submit an array of `array_tasks` tasks (queued behind the blocker), then cancel it; `array_runs` times."""
    out = ArrayTimes([], [], [])
    gpusched = os.path.join(os.path.dirname(sys.executable), "gpusched")
    spec_text = f"1-{sizes.array_tasks}"
    with Client(d.socket, timeout=120) as c:
        for _ in range(sizes.array_runs):
            t0 = time.perf_counter()
            made = c.call(SubmitRequest(spec=h.spec(["true"]), array=spec_text), SubmitResult)
            out.ack.append(time.perf_counter() - t0)
            if made.tasks != sizes.array_tasks:
                raise RuntimeError(f"array {made.job_id} has {made.tasks} tasks, not {sizes.array_tasks}")
            t0 = time.perf_counter()
            c.call(CancelRequest(job_ids=[made.job_id]), CancelResult)
            out.cancel.append(time.perf_counter() - t0)
            out.cli.append(h.time_process([gpusched, "--socket", d.socket, "submit", "--gpus", "1", "--array",
                                           spec_text, "--", "true"]))
            rows = c.call(QueueRequest(), QueueResult).arrays
            c.call(CancelRequest(job_ids=[r.id for r in rows]), CancelResult)
    return out


@dataclass
class Latency:
    ack: list[float]  # submit sent -> ack received
    starting: list[float]  # submit sent -> STARTING committed (devices chosen)
    running: list[float]  # submit sent -> RUNNING committed (process started)


def latency(daemons: dict[str, h.DaemonProc], samples: int) -> dict[str, Latency]:
    """Submit `true` (1 GPU) to an idle node, one at a time, and read the transition times from its
    history (the daemon stamps them with the same wall clock we read here). With several daemons
    (one per launcher) the samples alternate between them, so drift on a shared machine hits all alike."""
    out = {name: Latency([], [], []) for name in daemons}
    job = h.spec(["true"], gpus=1)
    with contextlib.ExitStack() as stack:
        clients = {name: stack.enter_context(Client(d.socket, timeout=60)) for name, d in daemons.items()}
        for _ in range(samples):
            for name, c in clients.items():
                t0 = time.time()
                job_id = h.submit_one(c, job)
                out[name].ack.append(time.time() - t0)
                done = c.call(WaitRequest(job_id=job_id, timeout_s=30), WaitResult)
                if not done.finished:
                    raise RuntimeError(f"job {job_id} did not finish within 30 s: {done.job.state}")
                at = {t.state: t.at for t in done.job.history}
                out[name].starting.append(at[JobState.STARTING] - t0)
                out[name].running.append(at[JobState.RUNNING] - t0)
    return out


def cli_times(d: h.DaemonProc, runs: int) -> dict[str, list[float]]:
    """Whole-process wall time of `gpusched submit`, of importing the CLI, and of `python -c pass`.

    Interleaved, so drift on a shared machine hits all three alike.
    """
    bindir = os.path.dirname(sys.executable)
    gpusched = os.path.join(bindir, "gpusched")
    commands = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "python -c 'import gpusched_cli.main'": [sys.executable, "-c", "import gpusched_cli.main"],
        "gpusched submit --gpus 1 -- true": [gpusched, "--socket", d.socket, "submit", "--gpus", "1", "--", "true"],
    }
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(runs):
        for name, argv in commands.items():
            times[name].append(h.time_process(argv))
    return times


def block_all_gpus(d: h.DaemonProc) -> int:
    """A running `sleep 3600` on all 8 GPUs, so submitted jobs stay PENDING and spawn nothing."""
    with Client(d.socket) as c:
        return h.submit_one(c, h.spec(["sleep", "3600"], gpus=8))


def report(floors: tuple[float, float], tput: Throughput, lats: dict[str, Latency],
           cli: dict[str, list[float]], arr: ArrayTimes, sizes: Sizes) -> None:
    floor = (floors[0] + floors[1]) / 2
    print("submit throughput (durable acks over the socket; jobs stay pending behind a blocker)")
    table = h.Table(["what", "per second", "ms each", "x the floor", "daemon CPU us each", "clients' CPU us each",
                     "submits per fsync"])
    table.add(f"SQLite INSERT+COMMIT, WAL, synchronous=FULL (floor; {floors[0]:.0f} before, {floors[1]:.0f} after)",
              floor, 1000 / floor, 1.0, "-", "-", 1)
    for clients, p in tput.phases.items():
        table.add(f"gpusched submit, {clients} concurrent clients", p.rate, 1000 / p.rate, p.rate / floor, p.cpu_us,
                  p.client_cpu_us, p.per_fsync)
    for clients, p in tput.single.items():
        table.add(f"gpuschedd, one COMMIT per submit (single_commit_daemon.py), {clients} concurrent clients",
                  p.rate, 1000 / p.rate, p.rate / floor, p.cpu_us, "-", p.per_fsync)
    for name, by_clients in tput.ceilings.items():
        for clients, (rate, cpu) in by_clients.items():
            table.add(f"{name}, {clients} concurrent clients", rate, 1000 / rate, rate / floor, cpu, "-", "-")
    print(table.render())
    print()
    print(f"job array of {sizes.array_tasks} tasks ({len(arr.ack)} runs; accepted = committed, one transaction)")
    table = h.Table(["what", "p50 ms", "max ms"])
    table.add(f"SubmitRequest(array=1-{sizes.array_tasks}) -> answer", 1000 * h.median(arr.ack), 1000 * max(arr.ack))
    table.add(f"gpusched submit --array 1-{sizes.array_tasks} (whole process)", 1000 * h.median(arr.cli),
              1000 * max(arr.cli))
    table.add("cancel ARRAY_ID -> answer (every task CANCELLED)", 1000 * h.median(arr.cancel), 1000 * max(arr.cancel))
    print(table.render())
    print()
    lat, base_lat = lats["forkserver"], lats["spawn"]
    print(f"submit->start latency on an idle node ({len(lat.ack)} sequential jobs per launcher, alternating, "
          "`true` on 1 GPU)")
    table = h.Table(["interval", "launcher", "p50 ms", "p99 ms", "max ms"])
    for launcher, sample in (("spawn", base_lat), ("forkserver", lat)):
        for name, values in (("submit -> ack", sample.ack), ("submit -> STARTING", sample.starting),
                             ("submit -> RUNNING", sample.running)):
            table.add(name, launcher, 1000 * h.median(values), 1000 * h.percentile(values, 99), 1000 * max(values))
    print(table.render())
    print()
    print(f"whole-process time ({len(next(iter(cli.values())))} runs each, interleaved)")
    base = h.median(cli["python -c pass"])
    table = h.Table(["command", "p50 ms", "max ms", "x python -c pass"])
    for name, values in cli.items():
        table.add(name, 1000 * h.median(values), 1000 * max(values), h.median(values) / base)
    print(table.render())
    print()
    print("ratios:")
    for clients, p in tput.phases.items():
        rate = p.rate
        print(f"  submit throughput, {clients} clients: {rate:.0f}/s = single-commit floor ({floor:.0f}/s) "
              f"x {rate / floor:.2f}; the daemon's CPU {p.cpu_us:.0f} us per submit, the clients' "
              f"{p.client_cpu_us:.0f} us, {p.per_fsync:.1f} submits per fsync")
        alone = tput.single[clients]
        print(f"    group commit: gpusched = the same daemon committing each submit alone ({alone.rate:.0f}/s, "
              f"{alone.cpu_us:.0f} us of CPU per submit) x {rate / alone.rate:.2f}")
        for name, by_clients in tput.ceilings.items():
            bare, cpu = by_clients[clients]
            print(f"    against {name} ({bare:.0f}/s = the floor x {bare / floor:.2f}, {cpu:.0f} us of CPU per "
                  f"submit): gpusched = {name} x {rate / bare:.2f}")
    print(f"  --array 1-{sizes.array_tasks} accepted in {1000 * h.median(arr.ack):.0f} ms p50 over the socket, "
          f"{1000 * h.median(arr.cli):.0f} ms as a whole `gpusched submit` process (goal <= 1000 ms)")
    for name, pick in (("p50", h.median), ("p99", lambda v: h.percentile(v, 99))):
        after, before = pick(lat.running), pick(base_lat.running)
        print(f"  submit->RUNNING {name} {1000 * after:.1f} ms with the fork server, {1000 * before:.1f} ms spawning "
              f"(baseline) = baseline / {before / after:.1f}")
    submit_p50 = h.median(cli["gpusched submit --gpus 1 -- true"])
    print(f"  gpusched submit process p50 {1000 * submit_p50:.0f} ms = python -c pass x{submit_p50 / base:.1f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CI smoke: a few hundred submits, few samples")
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL

    print(h.machine_line())
    d = h.DaemonProc(h.short_tmpdir("gba-"), extra_config=h.METRICS)  # launcher = "forkserver", the default
    spawn = h.DaemonProc(h.short_tmpdir("gbs-"), extra_config='launcher = "spawn"\n')  # the baseline launcher
    single = h.DaemonProc(h.short_tmpdir("gb1-"), extra_config=h.METRICS, program=h.SINGLE_COMMIT)
    try:
        d.start()
        spawn.start()
        os.makedirs(d.state_dir, exist_ok=True)
        lats = latency({"spawn": spawn, "forkserver": d}, sizes.latency_samples)  # first, while the node is idle
        spawn.cleanup()  # done with it: it must not take CPU from the throughput phases
        block_all_gpus(d)  # cleanup() kills it with the daemon
        single.start()  # (after the latency phase, which it must not share the machine with)
        block_all_gpus(single)
        before = sqlite_floor(d.state_dir, sizes.submits)  # the daemon's own disk and folder
        # the daemon's disk and folder, as the floor
        with h.BareServer(d.state_dir) as bare, h.BareServer(d.state_dir, checked=True) as checked:
            tput = throughput(d, single, {"bare_server.py": bare, "bare_server.py --checked": checked}, sizes)
        single.cleanup()  # done with it: it must not take CPU from the phases that follow
        after = sqlite_floor(d.state_dir, sizes.submits)
        arr = arrays(d, sizes)
        cli = cli_times(d, sizes.cli_runs)
        print()
        report((before, after), tput, lats, cli, arr, sizes)
        return 0
    finally:
        single.cleanup()
        spawn.cleanup()
        d.cleanup()


if __name__ == "__main__":
    sys.exit(main())
