"""Shared plumbing for the benchmark scripts: the real daemon as a child process, clients, figures.

Benchmarks run `gpuschedd` as the real program (not in-process) so that what we measure is what
users get: its own interpreter, uvloop, the socket, SQLite fsyncs, and /proc figures of one pid.
Scripts import this as `harness` (the script's folder is first on sys.path when run as a file).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypeVar

from prometheus_client.parser import text_string_to_metric_families

from gpusched.daemon.executor import kill_recorded_jobs
from gpusched.model import JobSpec, WholeRequest
from gpusched.protocol import (
    PROTOCOL_VERSION,
    CancelRequest,
    CancelResult,
    QueueRequest,
    QueueResult,
    SubmitRequest,
    SubmitResult,
    encode_frame,
)
from gpusched.wire import HEADER, decode_body, frame_length
from gpusched_cli.client import Client
from gpusched_cli.resubmit import new_request_id

T = TypeVar("T")

# Root runs the benchmarks here and is exempt from the per-user limits; raising them keeps the
# figures the same when an ordinary user runs the scripts (100k queued jobs, thousands of submits/s).
CONFIG = ('allow_root_jobs = true\ncgroup_root = "off"\n'
          "max_pending_per_user = 1000000\nsubmit_rate_per_user = 1000000.0\n")
SIM = "H100-80GB:8"
METRICS = 'metrics_address = "127.0.0.1:0"\n'  # extra_config for DaemonProc.metrics_counter
DAEMON = ("-m", "gpusched.daemon.main")  # DaemonProc's program: gpuschedd itself
# gpuschedd committing each submit alone (bench/single_commit_daemon.py): the baseline for group commit's gain
SINGLE_COMMIT = (os.path.join(os.path.dirname(os.path.abspath(__file__)), "single_commit_daemon.py"),)
JOB_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8"}


def wait_until(predicate: Callable[[], T], timeout: float, interval: float = 0.01, what: str = "") -> T:
    """Poll instead of sleeping a fixed time: benchmarks must not hide latency in sleeps."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


def short_tmpdir(prefix: str) -> str:
    """AF_UNIX paths are limited to 108 bytes, so keep the socket's folder short, under /tmp."""
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


def spec(argv: Sequence[str], gpus: int = 1, cwd: str = "/tmp", env: dict[str, str] | None = None) -> JobSpec:
    """A job spec with a small fixed environment (or `env`), so figures do not depend on the caller's env."""
    return JobSpec(argv=list(argv), cwd=cwd, env=dict(JOB_ENV if env is None else env), request=WholeRequest(gpus=gpus))


def module_env(kib: int) -> dict[str, str]:
    """An environment of about `kib` KiB, as a module system or conda leaves in a shell: JOB_ENV plus
    many long library and tool paths."""
    env = dict(JOB_ENV)
    k = 0
    while len(repr(env)) < 1024 * kib:
        env[f"MODULE_PATH_{k}"] = f"/opt/software/pkg{k}/1.2.3/lib:/opt/software/dep{k}/lib64:/usr/local/cuda/lib64"
        k += 1
    return env


@dataclass
class DaemonProc:
    """`python -m gpusched.daemon.main` (or another `program` taking its options) as a child process in
    its own session."""

    base: str
    sim: str = SIM
    proc: subprocess.Popen[bytes] | None = None
    extra_config: str = ""
    program: Sequence[str] = DAEMON

    @property
    def socket(self) -> str:
        return os.path.join(self.base, "g.sock")

    @property
    def state_dir(self) -> str:
        return os.path.join(self.base, "state")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 60.0, wrapper: Sequence[str] = ()) -> float:
        """Start the daemon (run by `wrapper`, e.g. valgrind, if given); returns seconds until its socket
        answers a hello."""
        config = os.path.join(self.base, "gpusched.toml")
        with open(config, "w") as f:
            f.write(CONFIG + self.extra_config)
        log = open(os.path.join(self.base, "daemon.log"), "ab")  # noqa: SIM115 - the child owns it
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            [*wrapper, sys.executable, *self.program, "--config", config, "--sim", self.sim,
             "--socket", self.socket, "--state-dir", self.state_dir],
            stdout=log, stderr=log, start_new_session=True,
        )
        log.close()
        wait_until(self._answers, timeout, what=f"gpuschedd on {self.socket}")
        return time.perf_counter() - t0

    def metrics_counter(self, name: str) -> float:
        """A counter of the daemon's metrics endpoint (started with `extra_config=METRICS`), by its
        full name (`..._total`); the port is the one the daemon logged, as it picks a free one."""
        with open(os.path.join(self.base, "daemon.log"), errors="replace") as f:
            found = re.findall(r"serving Prometheus metrics on http://([^/\s]+)/metrics", f.read())
        if not found:
            raise RuntimeError("the daemon serves no metrics: start it with extra_config=METRICS")
        with urllib.request.urlopen(f"http://{found[-1]}/metrics", timeout=10) as answer:
            text = answer.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name:
                    return float(sample.value)
        raise KeyError(f"no series {name} in the daemon's metrics")

    def _answers(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"gpuschedd exited with {self.proc.returncode}: {self.log_tail()}")
        try:
            with Client(self.socket, timeout=5):
                return True
        except Exception:
            return False

    def terminate(self, timeout: float = 60.0) -> float:
        """SIGTERM and wait; returns seconds until the process exited."""
        assert self.proc is not None
        t0 = time.perf_counter()
        self.proc.terminate()
        self.proc.wait(timeout)
        return time.perf_counter() - t0

    def log_tail(self) -> str:
        with open(os.path.join(self.base, "daemon.log"), errors="replace") as f:
            return f.read()[-3000:]

    def cleanup(self) -> None:
        """Kill the daemon and every job it started; remove the temp folder. Safe to call twice."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        kill_job_processes(self.state_dir)
        shutil.rmtree(self.base, ignore_errors=True)


kill_job_processes = kill_recorded_jobs  # jobs outlive the daemon under their shims


def stop_process(proc: subprocess.Popen[Any] | None, timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it will not go; for the servers we start in the foreground."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)


def remove_database(path: str) -> None:
    """An SQLite database in WAL mode and its two side files."""
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(path + suffix):
            os.remove(path + suffix)


class BareServer:
    """bench/bare_server.py as a child process (bench_api's ceiling): `with BareServer(folder) as bare:
    bare.socket`; `checked`: with --checked; `wrapper`: what runs it (valgrind, for instructions_daemon.py)."""

    SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bare_server.py")

    def __init__(self, folder: str, checked: bool = False, wrapper: Sequence[str] = ()) -> None:
        name = "checked" if checked else "bare"
        self.socket = os.path.join(folder, f"{name}.sock")
        self.database = os.path.join(folder, f"{name}.db")
        self.checked = checked
        self.wrapper = tuple(wrapper)
        self.proc: subprocess.Popen[str] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def __enter__(self) -> BareServer:
        repo = os.path.dirname(os.path.dirname(self.SCRIPT))  # (it imports gpusched: its framing, --checked more)
        path = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen([*self.wrapper, sys.executable, self.SCRIPT, self.socket, self.database,
                                      *(["--checked"] if self.checked else [])],
                                     stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": path},
                                     stderr=subprocess.DEVNULL if self.wrapper else None)  # (valgrind's report)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # (an exit closes the pipe: no wait for ever)
        if line.strip() != "ready":
            self.__exit__(None, None, None)
            raise RuntimeError(f"bench/bare_server.py did not start (exit status {self.proc.wait(10)})")
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        stop_process(self.proc)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        remove_database(self.database)


def submit_one(client: Client, job: JobSpec, request_id: str | None = None) -> int:
    return client.call(SubmitRequest(spec=job, request_id=request_id), SubmitResult).job_id


def submit_concurrently(socket_path: str, job: JobSpec | Callable[[int], JobSpec], total: int,
                        clients: int, request_ids: bool = False) -> tuple[float, list[int]]:
    """`total` submits spread over `clients` threads, each on its own connection (connected first).
    `job` is one spec for all, or a function from the submit's number (0..total-1) to its spec.
    `request_ids`: each submit carries one made as `gpusched submit` makes it, so the daemon keeps
    its key as it does for the CLI's submits.

    Returns (seconds from the first submit to the last ack, job ids). Threads, not processes:
    each blocks in recv() while the daemon works, so the GIL is not what limits the rate.
    """
    conns = [Client(socket_path, timeout=120) for _ in range(clients)]
    for c in conns:
        c.connect()

    def submits(i: int, first: int, count: int) -> list[int]:
        return [submit_one(conns[i], job if isinstance(job, JobSpec) else job(first + n),
                           new_request_id() if request_ids else None) for n in range(count)]

    try:
        return _in_threads(submits, total, clients)
    finally:
        for c in conns:
            c.close()


def send_submits_concurrently(socket_path: str, frame: Callable[[], bytes], total: int,
                              clients: int) -> tuple[float, list[int]]:
    """As `submit_concurrently`, but each client sends the frame bytes `frame()` makes (a submit as
    `gpusched submit` sends it, say) on a plain socket and reads the answer as the C front does: no
    model built or validated on the client's side, whose CPU shares the machine with the daemon's."""
    socks = []
    for _ in range(clients):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(120)
        sock.connect(socket_path)
        sock.sendall(encode_frame({"op": "hello", "version": PROTOCOL_VERSION, "client": "bench"}))
        _answer(sock)
        socks.append(sock)

    def submits(i: int, first: int, count: int) -> list[int]:
        ids = []
        for _ in range(count):
            socks[i].sendall(frame())
            reply = _answer(socks[i])
            if reply.get("ok") is not True:
                raise RuntimeError(f"submit refused: {reply}")
            ids.append(int(reply["result"]["job_id"]))
        return ids

    try:
        return _in_threads(submits, total, clients)
    finally:
        for sock in socks:
            sock.close()


def _answer(sock: socket.socket) -> dict[str, Any]:
    header = sock.recv(HEADER.size, socket.MSG_WAITALL)
    return decode_body(sock.recv(frame_length(header), socket.MSG_WAITALL))


def random_request_id() -> str:
    """128 random bits in hex: what `gpusched submit` sent as its request_id before round 18 (now
    resubmit.new_request_id), for the benchmarks that compare the two."""
    return os.urandom(16).hex()


def _in_threads(submits: Callable[[int, int, int], list[int]], total: int,
                clients: int) -> tuple[float, list[int]]:
    """Run `submits(client, first, count)` on `clients` threads at once, `total` split between them;
    (seconds from the start to the last one's end, every id in client order)."""
    per = [total // clients + (1 if i < total % clients else 0) for i in range(clients)]
    ids: list[list[int]] = [[] for _ in range(clients)]
    errors: list[BaseException] = []
    start = threading.Barrier(clients + 1)

    def work(i: int) -> None:
        start.wait()
        try:
            ids[i] = submits(i, sum(per[:i]), per[i])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return elapsed, [j for chunk in ids for j in chunk]


def cancel_all(client: Client, job_ids: Sequence[int], chunk: int = 10_000) -> None:
    """Cancel in chunks (the protocol takes at most 10 000 ids per request)."""
    for i in range(0, len(job_ids), chunk):
        client.call(CancelRequest(job_ids=list(job_ids[i:i + chunk])), CancelResult)


def queue_count(client: Client) -> int:
    return len(client.call(QueueRequest(), QueueResult).jobs)


def callgrind_instructions(argv: Sequence[str], out_dir: str, options: Sequence[str] = ()) -> tuple[int, str]:
    """Run the program `argv` under callgrind (with `options`, PYTHONHASHSEED=0) and return the
    instructions its own process ran, and its stdout. Valgrind runs the program in its own process, so
    its file is the one named by that pid (a process forked from it, without an exec, writes its own
    beside). A failed run raises CalledProcessError, its stderr attached."""
    out = os.path.join(out_dir, "callgrind.out.%p")
    proc = subprocess.Popen(["valgrind", "--tool=callgrind", *options, f"--callgrind-out-file={out}", *argv],
                            env={**os.environ, "PYTHONHASHSEED": "0"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate()
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, argv, stdout, stderr)
    return callgrind_total(os.path.join(out_dir, f"callgrind.out.{proc.pid}")), stdout


def callgrind_total(path: str) -> int:
    """The instructions a callgrind output file counts in all."""
    with open(path) as f:
        match = re.search(r"^(?:totals|summary): (\d+)", f.read(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"no totals in callgrind's output {path}")
    return int(match.group(1))


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile; fine for the few hundred samples a benchmark takes."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = max(0, min(len(ordered) - 1, round(p / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def compile_bytecode() -> None:
    """Write the .pyc files an installed package has, so no timed process pays for compiling source:
    with PYTHONDONTWRITEBYTECODE set (as in some shells and CI), every run would compile every module."""
    import compileall

    import gpusched
    import gpusched_cli

    for package in (gpusched, gpusched_cli):
        for folder in package.__path__:
            compileall.compile_dir(folder, quiet=1)


def time_process(argv: Sequence[str], env: dict[str, str] | None = None) -> float:
    """Wall time of one whole process, start to exit; raises if it fails."""
    t0 = time.perf_counter()
    subprocess.run(list(argv), check=True, stdout=subprocess.DEVNULL, env=env)
    return time.perf_counter() - t0


# ---- /proc figures -------------------------------------------------------------------------------


def rss_mib(pid: int) -> float:
    """VmRSS of a process in MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (not its children), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # fields 14 and 15 of stat(5), counted after the comm
    return ticks / os.sysconf("SC_CLK_TCK")


def idle_cpu_percent(pid: int, window_s: float) -> float:
    """CPU the process used over a quiet window, as % of one core."""
    c0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(window_s)  # the window itself is what we measure, so a fixed sleep is right here
    return 100 * (cpu_seconds(pid) - c0) / (time.monotonic() - t0)


# ---- printing ------------------------------------------------------------------------------------


@dataclass
class Table:
    """A plain fixed-width table: easy to read in CI logs and to paste into docs."""

    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)

    def add(self, *cells: object) -> None:
        self.rows.append([c if isinstance(c, str) else fmt(c) for c in cells])

    def render(self) -> str:
        widths = [max(len(r[i]) for r in [self.headers, *self.rows]) for i in range(len(self.headers))]
        lines = ["  ".join(h.ljust(w) for h, w in zip(self.headers, widths, strict=True))]
        lines.append("  ".join("-" * w for w in widths))
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in self.rows]
        return "\n".join(lines)


def fmt(value: object) -> str:
    if isinstance(value, float):
        if value != value:  # NaN
            return "n/a"
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def machine_line() -> str:
    """One line describing where the figures came from."""
    mem_kib = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    return (f"machine: {os.cpu_count()} CPUs, {mem_kib / 1024 / 1024:.1f} GiB RAM, "
            f"Python {sys.version.split()[0]}, {sys.platform}")
