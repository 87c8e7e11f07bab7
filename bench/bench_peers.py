"""gpusched against its peers: task-spooler (`tsp`) and Slurm, on the same machine, in the same run.

Each system is driven the way a user drives it, through its command-line client, one process per
submit: `gpusched submit` (the installed program: the C front where it was built), `tsp CMD`,
`sbatch --wrap CMD`; `gpusched-py` is the Python program alone (pip's console script), the C
front's baseline. We measure
  - submit throughput: submit processes per second from 1 and 16 concurrent submitters, while a
    blocker job holds the whole node so nothing else runs;
  - submit->start latency on an idle node: from just before the submit process is spawned until the
    job itself writes `date +%s.%N` into a file (the same job on every system);
  - one job array of 10,000 `true` tasks (`gpusched submit --array 1-10000`, `sbatch --array=1-10000`):
    the submit process's wall time, i.e. until the system has accepted every task (task-spooler has
    no arrays). gpusched's answer comes after the array is committed (fsync); Slurm's controller
    writes its state files in the background, so its answer is not durable yet.
Ratios are printed against gpusched. A peer that is not installed or will not start is skipped with
the reason, and the script still exits 0. Everything it starts is stopped at the end. Beside them,
the same throughput phases run `python -I -S -c pass`: the interpreter starting and exiting with
nothing imported, the most processes per second any Python client could reach on this machine.

    python bench/bench_peers.py            # full run (~2-3 min on 2 cores)
    python bench/bench_peers.py --quick    # CI smoke
    python bench/bench_peers.py --peers tsp,slurm

Install the peers with `apt-get install -y task-spooler slurm-wlm` (Debian names; see
docs/benchmarks.md for what Slurm needs configured: it is set up here in a temp dir).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import harness as h

from gpusched_cli import front_build
from gpusched_cli.client import Client


class SkipPeer(Exception):
    """This peer cannot be measured here; the message says why."""


@dataclass
class Sizes:
    submits: int  # per throughput phase
    latency_samples: int
    concurrency: tuple[int, ...]
    array_tasks: int = 10000  # one `--array 1-N` submit, timed as a whole process


FULL = Sizes(submits=160, latency_samples=20, concurrency=(1, 16))
QUICK = Sizes(submits=8, latency_samples=2, concurrency=(1, 4), array_tasks=100)


def run(argv: Sequence[str], env: dict[str, str] | None = None, timeout: float = 30.0,
        cwd: str | None = None) -> str:
    """Run a short command and return its stdout; raise with its stderr when it fails."""
    proc = subprocess.run(list(argv), env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
    return proc.stdout


@dataclass
class Peer:
    """A scheduler under test: how to start it, submit to it, block it and stop it."""

    name: str
    base: str = ""
    env: dict[str, str] = field(default_factory=dict)

    def start(self) -> None:
        raise NotImplementedError

    def submit_argv(self, command: str) -> list[str]:
        """The user-facing submit command for the shell command `command`."""
        raise NotImplementedError

    def block(self) -> None:
        """Occupy the whole node so later jobs stay queued."""
        raise NotImplementedError

    def array_argv(self, tasks: int) -> list[str] | None:
        """One submit of a job array of `tasks` tasks running `true`; None when the system has no arrays."""
        return None

    def stop(self) -> None:
        raise NotImplementedError


@dataclass
class Gpusched(Peer):
    daemon: h.DaemonProc | None = None

    def start(self) -> None:
        self.daemon = h.DaemonProc(self.base)
        self.daemon.start()
        self.env = dict(os.environ)

    def program(self) -> str:
        """The installed `gpusched`: the C front where it was built (front_build), else the console script."""
        return front_build.installed_path()

    def submit_argv(self, command: str) -> list[str]:
        assert self.daemon is not None
        return [self.program(), "--socket", self.daemon.socket, "submit", "--gpus", "1", "--", "sh", "-c", command]

    def array_argv(self, tasks: int) -> list[str] | None:
        assert self.daemon is not None
        return [self.program(), "--socket", self.daemon.socket, "submit", "--gpus", "1", "--array", f"1-{tasks}",
                "--", "true"]

    def block(self) -> None:
        assert self.daemon is not None
        with Client(self.daemon.socket) as c:
            h.submit_one(c, h.spec(["sleep", "3600"], gpus=8))

    def stop(self) -> None:
        if self.daemon is not None:
            self.daemon.cleanup()  # kills the daemon and every job process group it recorded


@dataclass
class GpuschedPython(Gpusched):
    """The Python program alone, as pip's console script runs it: the C front's baseline in the same run."""

    def program(self) -> str:
        path = os.path.join(self.base, "gpusched-py")
        if not os.path.exists(path):
            with open(path, "w") as f:
                f.write(f"#!{sys.executable}\nimport sys\nfrom gpusched_cli.fastpath import main\nsys.exit(main())\n")
            os.chmod(path, 0o755)
        return path


@dataclass
class TaskSpooler(Peer):
    """task-spooler with its own server socket (TS_SOCKET) in our temp dir, one slot."""

    binary: str = ""

    def start(self) -> None:
        self.binary = shutil.which("tsp") or shutil.which("ts") or ""
        if not self.binary:
            raise SkipPeer("task-spooler is not installed (apt-get install -y task-spooler; binary `tsp`)")
        self.env = {**os.environ, "TS_SOCKET": os.path.join(self.base, "ts.sock"), "TMPDIR": self.base,
                    "TS_SLOTS": "1", "TS_MAXFINISHED": "100000"}
        self.env.pop("TS_SAVELIST", None)
        run([self.binary, "-S", "1"], self.env)  # the first client call forks the server
        if not os.path.exists(self.env["TS_SOCKET"]):
            raise SkipPeer(f"tsp server did not create {self.env['TS_SOCKET']}")

    def submit_argv(self, command: str) -> list[str]:
        return [self.binary, "sh", "-c", command]  # prints the job id; output goes to a file in TMPDIR

    def block(self) -> None:
        job = run([self.binary, "sleep", "3600"], self.env).strip()  # with -n it prints no id
        h.wait_until(lambda: "running" in run([self.binary, "-s", job], self.env), timeout=10,
                     what="tsp blocker running")

    def stop(self) -> None:
        if not self.env:
            return
        with contextlib.suppress(Exception):
            run([self.binary, "-K"], self.env, timeout=5)  # the server and its queue first: nothing new starts
        # -K leaves each running job and the tsp process that waits for it alive, each in a session of
        # its own; all of them, and only they, carry our TS_SOCKET. (Killing only the blocker by its
        # pid left it running for an hour whenever the run failed before its pid was known.)
        kill_by_environ(f"TS_SOCKET={self.env['TS_SOCKET']}")


SLURM_CONF = """\
ClusterName=gsbench
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={base}/munge/munge.sock
CredType=cred/munge
StateSaveLocation={base}/ctld
SlurmdSpoolDir={base}/spool
SlurmctldPidFile={base}/slurmctld.pid
SlurmdPidFile={base}/slurmd.pid
SlurmctldLogFile={base}/log/slurmctld.log
SlurmdLogFile={base}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerParameters=batch_sched_delay=0
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
MaxJobCount=100000
MaxArraySize=100001
NodeName=localhost NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=bench Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def free_port() -> int:
    """A free localhost TCP port (tiny race until the daemon binds it; fine on a bench machine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Slurm(Peer):
    """munged + slurmctld + slurmd in the foreground as our children, all state under a temp dir."""

    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self) -> None:
        for tool in ("munged", "slurmctld", "slurmd", "sbatch", "scancel", "sinfo"):
            if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
                raise SkipPeer(f"`{tool}` not found (apt-get install -y slurm-wlm)")
        os.chmod(self.base, 0o755)  # munged insists that every folder above its socket is searchable
        for sub, mode in (("munge", 0o755), ("key", 0o700), ("ctld", 0o700), ("spool", 0o700), ("log", 0o700),
                          ("work", 0o755)):
            os.makedirs(os.path.join(self.base, sub), mode=mode)
        self._start_munge()
        conf = os.path.join(self.base, "slurm.conf")
        with open(conf, "w") as f:
            f.write(SLURM_CONF.format(base=self.base, ctld_port=free_port(), d_port=free_port()))
        self.env = {**os.environ, "SLURM_CONF": conf}
        self._spawn(["slurmctld", "-D", "-i", "-f", conf], "slurmctld.out")
        self._spawn(["slurmd", "-D", "-N", "localhost", "-f", conf], "slurmd.out")
        try:
            h.wait_until(self._node_idle, timeout=30, interval=0.2, what="slurm node idle")
        except TimeoutError:
            raise SkipPeer(f"slurm node never became idle: {self._log_tail()}") from None

    def _start_munge(self) -> None:
        key = os.path.join(self.base, "key", "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o600)
        sock = os.path.join(self.base, "munge", "munge.sock")
        self._spawn(["munged", "-F", f"--key-file={key}", f"--socket={sock}",
                     f"--pid-file={self.base}/munge/munged.pid", f"--seed-file={self.base}/key/seed",
                     f"--log-file={self.base}/log/munged.log"], "munged.out")
        try:
            h.wait_until(lambda: os.path.exists(sock), timeout=10, what="munged socket")
        except TimeoutError:
            raise SkipPeer(f"munged did not start: {self._log_tail()}") from None

    def _spawn(self, argv: list[str], log_name: str) -> None:
        log = open(os.path.join(self.base, "log", log_name), "ab")  # noqa: SIM115 - the child owns it
        self.procs.append(subprocess.Popen(argv, stdout=log, stderr=log, env=self.env or None,
                                           start_new_session=True))
        log.close()
        time.sleep(0)  # let it be scheduled; readiness is polled by the caller

    def _node_idle(self) -> bool:
        for proc in self.procs:
            if proc.poll() is not None:
                raise SkipPeer(f"{proc.args[0]} exited with {proc.returncode}: {self._log_tail()}")
        try:
            return run(["sinfo", "-h", "-o", "%T"], self.env, timeout=5).strip() == "idle"
        except (RuntimeError, subprocess.TimeoutExpired):
            return False

    def _log_tail(self) -> str:
        out = []
        for name in ("munged.out", "slurmctld.out", "slurmd.out"):
            path = os.path.join(self.base, "log", name)
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    out.append(f"{name}: {f.read()[-400:]}")
        return " | ".join(out)

    def submit_argv(self, command: str) -> list[str]:
        return ["sbatch", "-Q", "-o", "/dev/null", "-D", os.path.join(self.base, "work"), "--wrap", command]

    def array_argv(self, tasks: int) -> list[str] | None:
        return ["sbatch", "-Q", "-o", "/dev/null", "-D", os.path.join(self.base, "work"), f"--array=1-{tasks}",
                "--wrap", "true"]

    def block(self) -> None:
        run(["sbatch", "-Q", "--exclusive", "-o", "/dev/null", "-D", os.path.join(self.base, "work"),
             "--wrap", "sleep 3600"], self.env)
        h.wait_until(lambda: "R" in run(["squeue", "-h", "-o", "%t"], self.env).split(), timeout=30,
                     interval=0.1, what="slurm blocker running")

    def stop(self) -> None:
        if self.env:
            with contextlib.suppress(Exception):
                run(["scancel", "--partition=bench"], self.env, timeout=10)
                h.wait_until(lambda: not run(["squeue", "-h"], self.env).strip(), timeout=15, interval=0.2,
                             what="slurm queue empty")
        for proc in reversed(self.procs):  # slurmd, slurmctld, then munged
            h.stop_process(proc)
        kill_strays(self.base)


def pids_where(name: str, matches: Callable[[bytes], bool]) -> list[int]:
    """Processes of ours (bar this one) whose /proc/PID/`name` (cmdline, environ) `matches`."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/{name}", "rb") as f:
                content = f.read()
        except OSError:  # gone, or not ours to read
            continue
        if matches(content):
            found.append(int(pid))
    return found


def processes_with_environ(entry: str) -> list[int]:
    """Processes whose environment holds `entry` (`NAME=value`, exactly). A zombie's reads empty."""
    if not entry.partition("=")[0]:  # ("" would match the empty string after every environment's last NUL)
        raise ValueError(f"not a NAME=value environment entry: {entry!r}")
    wanted = entry.encode()
    return pids_where("environ", lambda environ: wanted in environ.split(b"\0"))


def kill_all(pids: list[int]) -> int:
    """SIGKILL each; how many were still there to kill."""
    killed = 0
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
            killed += 1
    return killed


def kill_by_environ(entry: str) -> int:
    """SIGKILL every process of ours whose environment holds `entry`; how many."""
    return kill_all(processes_with_environ(entry))


def kill_strays(base: str) -> None:
    """Kill processes still running a job script from our spool dir (a job slurmd left behind)."""
    kill_all(pids_where("cmdline", lambda cmdline: base.encode() in cmdline))


# ---- measurements --------------------------------------------------------------------------------


@dataclass
class Result:
    name: str
    rates: dict[int, float] = field(default_factory=dict)  # concurrent submitters -> submits/s
    latency: list[float] = field(default_factory=list)  # submit spawned -> job wrote its stamp
    submit_proc: list[float] = field(default_factory=list)  # the submit process's own wall time
    array_s: float | None = None  # one array submit of Sizes.array_tasks tasks, whole process; None: no arrays
    skipped: str = ""


def measure_latency(peer: Peer, samples: int, stamp_dir: str) -> tuple[list[float], list[float]]:
    """One job at a time on an idle node; the job writes its own start time into a file."""
    latencies, procs = [], []
    for i in range(samples):
        stamp = os.path.join(stamp_dir, f"{peer.name}-{i}.stamp")
        t0 = time.time()
        subprocess.run(peer.submit_argv(f"date +%s.%N > {stamp}.tmp && mv {stamp}.tmp {stamp}"), env=peer.env,
                       check=True, stdout=subprocess.DEVNULL, timeout=30)
        procs.append(time.time() - t0)
        h.wait_until(lambda s=stamp: os.path.exists(s), timeout=60, interval=0.002, what=f"{peer.name} job start")
        with open(stamp) as f:
            latencies.append(float(f.read()) - t0)
    return latencies, procs


def measure_throughput(peer: Peer, total: int, concurrency: int) -> float:
    """Submit processes per second, `concurrency` at a time; the jobs stay queued behind the blocker."""
    argv = peer.submit_argv("true")
    counts = [total // concurrency + (1 if i < total % concurrency else 0) for i in range(concurrency)]
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            for _ in range(n):
                subprocess.run(argv, env=peer.env, check=True, stdout=subprocess.DEVNULL, timeout=60)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in counts]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return total / (time.perf_counter() - t0)


def bench_peer(make: Callable[[str], Peer], sizes: Sizes) -> Result:
    base = h.short_tmpdir("gbp-")
    peer = make(base)
    result = Result(peer.name)
    try:
        peer.start()
        result.latency, result.submit_proc = measure_latency(peer, sizes.latency_samples, base)
        peer.block()
        for c in sizes.concurrency:
            result.rates[c] = measure_throughput(peer, sizes.submits, c)
        argv = peer.array_argv(sizes.array_tasks)
        if argv is not None:  # last: its tasks stay queued behind the blocker until the peer is stopped
            t0 = time.perf_counter()
            subprocess.run(argv, env=peer.env, check=True, stdout=subprocess.DEVNULL, timeout=120)
            result.array_s = time.perf_counter() - t0
    except SkipPeer as exc:
        result.skipped = str(exc)
    except Exception as exc:  # a peer that breaks mid-run is reported, not fatal
        result.skipped = f"failed: {type(exc).__name__}: {exc}"
    finally:
        peer.stop()
        shutil.rmtree(base, ignore_errors=True)
    return result


@dataclass
class Interpreter(Peer):
    """Not a scheduler: the Python interpreter alone, started and exited, as the floor of a Python client."""

    def start(self) -> None:
        self.env = dict(os.environ)

    def submit_argv(self, command: str) -> list[str]:
        return [sys.executable, "-I", "-S", "-c", "pass"]

    def block(self) -> None:
        pass

    def stop(self) -> None:
        pass


def interpreter_rates(sizes: Sizes) -> dict[int, float]:
    """Processes per second of `python -I -S -c pass`, in the throughput phases' shape."""
    floor = Interpreter("python -I -S -c pass")
    floor.start()
    return {c: measure_throughput(floor, sizes.submits, c) for c in sizes.concurrency}


PEERS: dict[str, Callable[[str], Peer]] = {
    "gpusched": lambda base: Gpusched("gpusched", base),
    "gpusched-py": lambda base: GpuschedPython("gpusched-py", base),
    "tsp": lambda base: TaskSpooler("tsp", base),
    "slurm": lambda base: Slurm("slurm", base),
}


def report(results: list[Result], sizes: Sizes, floor: dict[int, float]) -> None:
    ours = results[0]
    table = h.Table(["system", *[f"submits/s x{c}" for c in sizes.concurrency], "submit proc p50 ms",
                     "submit->start p50 ms", "p99 ms", "max ms", f"--array 1-{sizes.array_tasks} ms"])
    for r in results:
        if r.skipped:
            table.add(r.name, *["skipped"] * (len(sizes.concurrency) + 5))
            continue
        table.add(r.name, *[r.rates[c] for c in sizes.concurrency], 1000 * h.median(r.submit_proc),
                  1000 * h.median(r.latency), 1000 * h.percentile(r.latency, 99), 1000 * max(r.latency),
                  1000 * r.array_s if r.array_s is not None else "no arrays")
    print(table.render())
    print()
    print("the interpreter alone (python -I -S -c pass, nothing imported), the ceiling of any Python client: "
          + ", ".join(f"{floor[c]:.1f} processes/s x{c}" for c in sizes.concurrency))
    for r in results:
        if not r.skipped:
            print(f"  {r.name}: " + ", ".join(f"{r.rates[c] / floor[c]:.2f} of it x{c}" for c in sizes.concurrency))
    print()
    for r in results:
        if r.skipped:
            print(f"SKIPPED {r.name}: {r.skipped}")
    if ours.skipped:
        print("no ratios: gpusched itself could not be measured")
        return
    if all(r.skipped for r in results[1:]):
        print("no ratios: no peer could be measured")
        return
    print("ratios (peer / gpusched; >1 means the peer is faster or, for latency, slower):")
    for r in results[1:]:
        if r.skipped:
            continue
        rates = ", ".join(f"x{c}: {r.rates[c] / ours.rates[c]:.1f}" for c in sizes.concurrency)
        print(f"  {r.name}: throughput {rates}; submit->start p50 latency "
              f"{h.median(r.latency) / h.median(ours.latency):.2f} "
              f"({1000 * h.median(r.latency):.0f} ms vs {1000 * h.median(ours.latency):.0f} ms)")
        if r.array_s is not None and ours.array_s is not None:
            print(f"  {r.name}: one --array 1-{sizes.array_tasks} submit process takes {1000 * r.array_s:.0f} ms vs "
                  f"gpusched's {1000 * ours.array_s:.0f} ms (x{r.array_s / ours.array_s:.3f})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CI smoke: a few submits and samples per peer")
    parser.add_argument("--peers", default="gpusched-py,tsp,slurm",
                        help="comma-separated: gpusched-py (the Python program alone), tsp, slurm (gpusched always "
                             "runs)")
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    wanted = ["gpusched", *[p for p in args.peers.split(",") if p and p != "gpusched"]]
    unknown = [p for p in wanted if p not in PEERS]
    if unknown:
        parser.error(f"unknown peers {unknown}; choose from {sorted(PEERS)}")

    h.compile_bytecode()
    print(h.machine_line())
    print(f"gpusched: {front_build.describe_installed()}")
    print(f"{sizes.submits} submits per throughput phase, {sizes.latency_samples} latency samples per system")
    results = []
    for name in wanted:
        print(f"  measuring {name} ...", flush=True)
        results.append(bench_peer(PEERS[name], sizes))
    print("  measuring the interpreter alone ...", flush=True)
    floor = interpreter_rates(sizes)
    print()
    report(results, sizes, floor)
    return 0


if __name__ == "__main__":
    sys.exit(main())
