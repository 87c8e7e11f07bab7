"""Load: 1,000 concurrent connections, idle or slow-writing, while normal clients submit and query.

The crowd runs in a separate process (as other local users' programs would): half the connections
sit idle (some after `hello`, some before sending a byte), half drip a frame one byte at a time
(slow-loris). Meanwhile normal clients in this process connect, submit, list and show, as the CLI
does, one connection per command. Every normal request must complete; latency figures (p50/p99 per
request type) are printed to the terminal and recorded as junit properties.
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from gpusched.model import JobSpec, WholeRequest
from gpusched.protocol import (
    QueueRequest,
    QueueResult,
    ShowRequest,
    ShowResult,
    SubmitRequest,
    SubmitResult,
)
from gpusched_cli.client import Client
from tests.conftest import DaemonHandle, wait_until

IDLE, SLOW = 500, 500
NORMAL_CLIENTS = 4
DURATION_S = 6.0

# The crowd: open every connection, say "ready", drip bytes until stdin closes, report counts.
_CROWD = r"""
import json, os, resource, select, socket, struct, sys, time
path, n_idle, n_slow, drip_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
def frame(obj):
    body = json.dumps(obj).encode()
    return struct.pack(">I", len(body)) + body
hello = frame({"op": "hello", "version": "1.0", "client": "crowd"})
idle = []
for i in range(n_idle):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    if i % 2 == 0:  # half greet first, then go quiet; the rest never send a byte
        s.sendall(hello)
        s.settimeout(30)
        header = s.recv(4, socket.MSG_WAITALL)
        s.recv(struct.unpack(">I", header)[0], socket.MSG_WAITALL)
    idle.append(s)
slow = []
for i in range(n_slow):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.setblocking(False)
    slow.append([s, hello + frame({"op": "gpus"}), 0])
print("ready", flush=True)
sent = replies = 0
while not select.select([sys.stdin], [], [], drip_s)[0]:
    for entry in slow:
        s, data, pos = entry
        if pos < len(data):
            try:
                s.send(data[pos:pos + 1])
                entry[2] += 1
                sent += 1
            except BlockingIOError:
                pass
        try:
            replies += len(s.recv(65536)) > 0
        except BlockingIOError:
            pass
print(json.dumps({"bytes_dripped": sent, "reads_with_data": replies}), flush=True)
"""


def raise_nofile(want: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is below the {want} descriptors this test needs")


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def spec(name: str) -> JobSpec:
    return JobSpec(argv=["true"], cwd="/tmp", request=WholeRequest(gpus=1), name=name)


def test_normal_requests_complete_under_a_thousand_connections(
    daemon_factory: Callable[..., DaemonHandle], capsys: pytest.CaptureFixture[str],
    record_property: Callable[[str, object], None],
) -> None:
    raise_nofile(4 * (IDLE + SLOW) + 256)
    d = daemon_factory(max_connections=2000)
    crowd = subprocess.Popen([sys.executable, "-c", _CROWD, d.socket, str(IDLE), str(SLOW), "0.25"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    with crowd:
        assert crowd.stdout is not None and crowd.stdin is not None
        assert crowd.stdout.readline().strip() == "ready", "the crowd could not open its connections"
        assert d.daemon is not None
        server = d.daemon.server
        open_now = wait_until(lambda: (n := d.call_in_loop(lambda: len(server._connections))) >= IDLE + SLOW and n,
                              timeout=20, what="1,000 connections open in the daemon")

        latencies: dict[str, list[float]] = {"connect+hello": [], "submit": [], "queue": [], "show": []}
        errors: list[str] = []
        lock = threading.Lock()
        deadline = time.monotonic() + DURATION_S

        def timed(op: str, fn: Callable[..., Any], *args: Any) -> Any:
            began = time.perf_counter()
            result = fn(*args)
            with lock:
                latencies[op].append(time.perf_counter() - began)
            return result

        def normal_client(n: int) -> None:
            i = 0
            try:
                while time.monotonic() < deadline:
                    c = Client(d.socket, timeout=30)
                    timed("connect+hello", c.connect)
                    try:
                        job_id = timed("submit", c.call, SubmitRequest(spec=spec(f"load-{n}-{i}"), hold=True),
                                       SubmitResult).job_id
                        rows = timed("queue", c.call, QueueRequest(), QueueResult).jobs
                        assert any(r.id == job_id for r in rows)
                        shown = timed("show", c.call, ShowRequest(job_id=job_id), ShowResult).job
                        assert shown.spec.name == f"load-{n}-{i}"
                    finally:
                        c.close()
                    i += 1
            except Exception as exc:  # surfaced below with the client's number
                errors.append(f"client {n}: {type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=normal_client, args=(n,)) for n in range(NORMAL_CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(DURATION_S + 60)
        still_open = d.call_in_loop(lambda: len(server._connections))
        crowd.stdin.close()
        crowd_report = crowd.stdout.readline().strip()
        crowd.wait(30)

    assert not errors, errors
    requests = sum(len(v) for v in latencies.values())
    lines = [f"load: {open_now} connections held open ({IDLE} idle, {SLOW} slow-writing; {still_open} still open "
             f"at the end), {NORMAL_CLIENTS} normal clients, {requests} requests in {DURATION_S:g}s; crowd "
             f"{crowd_report}"]
    for op, values in latencies.items():
        assert values, f"no {op} completed"
        p50, p99 = percentile(values, 50) * 1000, percentile(values, 99) * 1000
        lines.append(f"  {op:<14} n={len(values):<5} p50={p50:7.2f} ms  p99={p99:7.2f} ms  "
                     f"max={max(values) * 1000:7.2f} ms  mean={statistics.fmean(values) * 1000:7.2f} ms")
        record_property(f"{op}_p50_ms", round(p50, 2))
        record_property(f"{op}_p99_ms", round(p99, 2))
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert still_open >= IDLE + SLOW, "the crowd's connections were dropped during the run"
    assert all(len(v) >= 20 for v in latencies.values()), "normal clients were starved"
    assert max(max(v) for v in latencies.values()) < 5.0, "a normal request took over 5 s"


_HOG = r"""
import os, socket, sys, time
path, n = sys.argv[1], int(sys.argv[2])
os.setgroups([]); os.setgid(12345); os.setuid(12345)
held = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
    except OSError:
        break
    held.append(s)
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch uids")
def test_one_user_cannot_lock_everyone_out_with_idle_connections(daemon_factory: Callable[..., DaemonHandle]) -> None:
    """An ordinary user gets at most a quarter of max_connections; root is never locked out."""
    limit = 50
    d = daemon_factory(max_connections=limit)
    assert d.daemon is not None
    server = d.daemon.server
    hog = subprocess.Popen([sys.executable, "-c", _HOG, d.socket, str(limit)], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    with hog:
        assert hog.stdout is not None and hog.stdout.readline().strip() == "ready"
        try:
            surplus = limit - server.per_uid_limit
            wait_until(lambda: d.call_in_loop(lambda: server.refused_connections) >= surplus,
                       what="the hog's surplus connections refused")
            held = d.call_in_loop(lambda: server._per_uid.get(12345, 0))
            assert held == server.per_uid_limit == 12
            with Client(d.socket, timeout=10) as c:  # root is served while uid 12345 holds its share
                c.call(QueueRequest(), QueueResult)
        finally:
            hog.kill()
