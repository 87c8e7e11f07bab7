"""A local user against the root daemon: what an audit found one could do to stall it or break a
reply for everyone (each test failed on the code before its fix). Needs root (to switch uids) and
/usr/bin/python3 (a Python any uid can run: the venv's may live where they cannot)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from gpusched.protocol import MAX_FRAME, PROTOCOL_VERSION, encode_frame
from tests.conftest import DaemonHandle, wait_until
from tests.integration.test_daemon import _read
from tests.integration.test_identity import as_user

UID = 23457
USER_PY = "/usr/bin/python3"  # the venv's interpreter lives under /root: other uids cannot run it

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not os.access(USER_PY, os.X_OK),
                                reason="needs root and /usr/bin/python3")


def _spec(*argv: str, **kw: Any) -> dict[str, Any]:
    return {"argv": list(argv), "cwd": "/tmp", "env": {"PATH": "/usr/bin:/bin"},
            "request": {"kind": "whole", "gpus": 1}, **kw}


def _raw(sock_path: str, *bodies: bytes, timeout: float = 20) -> list[dict[str, Any]]:
    """Send hello, then each raw body as a frame; return every reply after hello."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(timeout)
        s.connect(sock_path)
        s.sendall(encode_frame({"op": "hello", "version": PROTOCOL_VERSION}))
        for b in bodies:
            s.sendall(struct.pack(">I", len(b)) + b)
        s.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := s.recv(1 << 20):
            data += chunk
    out = []
    while data:
        n = struct.unpack(">I", data[:4])[0]
        out.append(json.loads(data[4 : 4 + n]))
        data = data[4 + n :]
    return out[1:]


def _timed_root(handle: DaemonHandle, message: dict[str, Any]) -> float:
    t = time.monotonic()
    with handle.client() as c:
        c.raw_call(message)
    return time.monotonic() - t


# ---- 1. a write lease on one's own log stalls the whole event loop for lease-break-time (45 s) ------

LEASE_JOB = r"""
import fcntl, os, signal, sys, time
log = os.readlink("/proc/self/fd/1")
for fd in range(64):
    try: os.close(fd)
    except OSError: pass
signal.signal(signal.SIGIO, signal.SIG_IGN)   # never answer the lease break
fd = os.open(log, os.O_RDONLY)
fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)   # the user owns the log, so this is allowed
open(sys.argv[1], "w").close()
time.sleep(600)
"""


def test_a_lease_on_ones_own_log_does_not_stall_the_daemon(daemon: DaemonHandle) -> None:
    base = os.path.dirname(daemon.socket)
    script = os.path.join(base, "lease.py")
    with open(script, "w") as f:
        f.write(LEASE_JOB)
    os.chmod(script, 0o644)
    marker = tempfile.mktemp(prefix="gs-lease-", dir="/tmp")
    [sub] = as_user(UID, daemon.socket, {"op": "submit", "spec": _spec(USER_PY, script, marker)})
    job_id = sub["result"]["job_id"]
    wait_until(lambda: os.path.exists(marker), timeout=20, what="the job holds a write lease on its log")
    # The owner asks for its own log: the daemon's open() of the log now waits for the lease break.
    asker = threading.Thread(target=as_user, args=(UID, daemon.socket, {"op": "logs", "job_id": job_id}),
                             daemon=True)
    asker.start()
    time.sleep(1.0)
    took = _timed_root(daemon, {"op": "queue"})  # anyone else, root included
    os.unlink(marker)
    assert took < 3.0, f"`queue` from root took {took:.1f} s: the event loop was blocked in open() of a leased log"


# ---- 2. one user's `stats` requests fill the default executor: the engine's tick waits behind them ---

FLOOD = r"""
import json, os, socket, struct, sys, threading, time
uid, path, n, secs = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
os.setgroups([]); os.setgid(uid); os.setuid(uid)
def frame(o):
    b = json.dumps(o).encode(); return struct.pack(">I", len(b)) + b
def recv(s):
    h = b""
    while len(h) < 4:
        c = s.recv(4 - len(h))
        if not c: raise EOFError
        h += c
    n = struct.unpack(">I", h)[0]; b = b""
    while len(b) < n:
        c = s.recv(n - len(b))
        if not c: raise EOFError
        b += c
stop = time.monotonic() + secs
def work():
    s = socket.socket(socket.AF_UNIX); s.connect(path); s.settimeout(300)
    s.sendall(frame({"op": "hello", "version": "1.1"})); recv(s)
    while time.monotonic() < stop:
        s.sendall(frame({"op": "stats", "since_s": 366 * 86400})); recv(s)
ts = [threading.Thread(target=work, daemon=True) for _ in range(n)]
[t.start() for t in ts]; [t.join() for t in ts]
"""


def test_one_users_stats_requests_do_not_stall_scheduling(daemon: DaemonHandle) -> None:
    # 10,001 finished jobs of this user (one held array, cancelled): stats reads ~0.1 s each.
    [sub] = as_user(UID, daemon.socket, {"op": "submit", "spec": _spec("true"), "hold": True, "array": "0-10000"})
    as_user(UID, daemon.socket, {"op": "cancel", "job_ids": [sub["result"]["job_id"]]})
    flood = subprocess.Popen([sys.executable, "-c", FLOOD, str(UID), daemon.socket, "30", "20"])
    try:
        time.sleep(3)
        t = time.monotonic()
        with daemon.client() as c:
            job_id = c.raw_call({"op": "submit", "spec": _spec("sleep", "30")})["result"]["job_id"]
            wait_until(lambda: c.raw_call({"op": "show", "job_id": job_id})["result"]["job"]["state"] == "RUNNING",
                       timeout=60, what="root's job to start")
        start = time.monotonic() - t
        all_took = _timed_root(daemon, {"op": "queue", "all": True, "limit": 5})
    finally:
        flood.kill()
        flood.wait()
    assert start < 5.0 and all_took < 5.0, (
        f"with one user's 50 connections asking for stats: root's job took {start:.1f} s to start on an idle "
        f"GPU (the tick awaits refresh_inventory in the same saturated executor) and `queue --all` {all_took:.1f} s")


# ---- 3. --after pinned whole arrays: max_finished_jobs no longer bounded the database ----------------

def test_a_held_dependency_cannot_pin_unbounded_finished_jobs(daemon_factory: Callable[..., DaemonHandle]) -> None:
    handle = daemon_factory(max_finished_jobs=10)
    arrays = []
    for _ in range(3):
        [sub] = as_user(UID, handle.socket, {"op": "submit", "spec": _spec("true"), "hold": True, "array": "0-999"})
        arrays.append(sub["result"]["job_id"])
        as_user(UID, handle.socket, {"op": "cancel", "job_ids": [arrays[-1]]})
    after = [{"job_id": a, "condition": "any"} for a in arrays]
    [held] = as_user(UID, handle.socket, {"op": "submit", "spec": _spec("true", after=after), "hold": True})
    assert held["ok"], held
    assert handle.daemon is not None and handle.loop is not None
    asyncio.run_coroutine_threadsafe(handle.daemon.prune(), handle.loop).result(60)
    with handle.client() as c:
        kept = c.raw_call({"op": "queue", "all": True, "array_tasks": True, "limit": 3000})["result"]["total"]
    # docs/security.md: "Submit-and-cancel therefore grows the database by at most 10,000 x 256 KiB ...
    # whatever the rate". One held job (64 --after slots) pinned 64 x 10,001 finished tasks.
    assert kept <= 10 + 3 * 5 + 1, f"{kept} finished jobs kept with max_finished_jobs = 10, pinned by one held job"
    with handle.client() as c:  # and the held job still reads how each array ended
        c.raw_call({"op": "release", "job_ids": [held["result"]["job_id"]]})
        wait_until(lambda: c.raw_call({"op": "show", "job_id": held["result"]["job_id"]})["result"]["job"]["state"]
                   == "COMPLETED", what="the job after the three cancelled arrays (--after ...:any) to run")


# ---- 4. malformed input that is answered `internal` (with a traceback in the log) ------------------

@pytest.mark.parametrize("field", ["argv", "env"])
def test_a_lone_surrogate_in_a_spec_is_a_bad_request(daemon: DaemonHandle, field: str) -> None:
    """name and cwd with "\\udcff" are bad_request; argv and env get `internal` and a traceback
    (store.py: spec.model_dump_json() raises UnicodeEncodeError)."""
    spec = _spec("true", "\udcff") if field == "argv" else _spec("true", env={"A": "\udcff"})
    [reply] = _raw(daemon.socket, json.dumps({"op": "submit", "spec": spec}).encode())
    assert reply["ok"] is False and reply["error"]["code"] == "bad_request", reply


def test_an_oversized_unknown_op_is_a_bad_request(daemon: DaemonHandle) -> None:
    body = b'{"op":"' + b"a" * (MAX_FRAME - 20) + b'"}'
    [reply] = _raw(daemon.socket, body)
    assert reply["ok"] is False and reply["error"]["code"] == "bad_request", reply["error"]["message"][:200]


# ---- 5. a connection that never says hello is never closed ----------------------------------------

def test_a_connection_that_never_says_hello_is_closed(daemon: DaemonHandle) -> None:
    """docs/security.md: a connection that has not said hello within 10 s is closed. Each answer to
    another request (hello_required) started the 10 s again, so such a connection stayed for ever."""
    replies: list[dict[str, Any]] = []
    began = time.monotonic()
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(daemon.socket)
        try:
            for _ in range(8):  # one non-hello request every 3 s: 24 s, if nobody closes it
                s.sendall(encode_frame({"op": "queue"}))
                replies.append(_read(s))
                time.sleep(3)
            replies.append(_read(s))
        except (AssertionError, ConnectionError, TimeoutError):
            pass  # closed
    took = time.monotonic() - began
    assert all(r["error"]["code"] == "hello_required" for r in replies), replies
    assert took < 20, f"a connection without hello stayed {took:.0f} s ({len(replies)} answers)"


# ---- 6. a job's history grows without bound: `show`/`wait` of it stop fitting in a frame ------------

def test_hold_release_cycles_cannot_make_a_job_unshowable(daemon: DaemonHandle) -> None:
    """docs/security.md (job spec row): "`show` and `wait` of any job fit in one frame". Every hold,
    release, suspend and resume appends a transition (store.py: history=[*job.history, t], an O(n) copy
    each), unbounded and uncounted by max_pending_bytes_per_user; ~3,000 a second from one connection."""
    with daemon.client() as c:  # both GPUs busy: a released job stays PENDING
        busy = c.raw_call({"op": "submit", "spec": {**_spec("sleep", "120"), "request": {"kind": "whole", "gpus": 2}}})
        wait_until(lambda: c.raw_call({"op": "show", "job_id": busy["result"]["job_id"]})["result"]["job"]["state"]
                   == "RUNNING", what="the GPUs to be busy")
    [sub] = as_user(UID, daemon.socket, {"op": "submit", "spec": _spec("true"), "hold": True})
    job_id = sub["result"]["job_id"]
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(60)
        s.connect(daemon.socket)
        s.sendall(encode_frame({"op": "hello", "version": PROTOCOL_VERSION}))
        _read(s)
        last: dict[str, Any] = {}
        for start in range(0, 3_000, 200):  # pipelined, 200 at a time
            s.sendall(b"".join(encode_frame({"op": "release" if i % 2 == 0 else "hold", "job_ids": [job_id]})
                               for i in range(start, start + 200)))
            for _ in range(200):
                last = _read(s)
    with daemon.client() as c:
        shown = c.raw_call({"op": "show", "job_id": job_id})
        waited = c.raw_call({"op": "wait", "job_id": job_id, "timeout_s": 0})
    assert shown["ok"] and waited["ok"], (shown.get("error"), waited.get("error"))
    assert len(shown["result"]["job"]["history"]) <= 1001
    assert "after 1000 it can no longer be held" in str(last["result"]["unchanged"]), last
