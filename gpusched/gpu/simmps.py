#!/usr/bin/env python3
"""A simulated `nvidia-cuda-mps-control`: same invocation and stdin command protocol.

The daemon runs it for `mps` share-mode devices when it drives simulated GPUs (`--sim`), and the
tests run it in place of the real binary, so the real MPS code path (gpu/mps.py) runs everywhere.
Standard library only: it is executed directly (`#!/usr/bin/env python3`), outside the venv.

`-d` daemonizes (double fork), writes nvidia-cuda-mps-control.pid into CUDA_MPS_PIPE_DIRECTORY,
logs to CUDA_MPS_LOG_DIRECTORY/control.log and serves commands on a Unix socket in the pipe
directory. A plain invocation reads commands from stdin, forwards each to the daemon and prints the
replies. `start_server -uid N` forks a real (idle) "server" process so pids are real; `quit` stops
the servers and the daemon. One server uid at a time, like MPS without -multiuser-server.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sys
import time

PIPE = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
LOGDIR = os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps")
SOCK = os.path.join(PIPE, "control")
PIDFILE = os.path.join(PIPE, "nvidia-cuda-mps-control.pid")


def log(msg: str) -> None:
    with open(os.path.join(LOGDIR, "control.log"), "a") as f:
        f.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {msg}\n")


class State:
    def __init__(self) -> None:
        self.thread_pct = 100.0
        self.mem_limits: dict[str, str] = {}
        self.servers: dict[int, int] = {}  # pid -> uid
        # What each server gives clients that connect from now on: the defaults when it started,
        # changed by set_active_thread_percentage / set_device_pinned_mem_limit (a server's own).
        self.server_pct: dict[int, float] = {}
        self.server_mem: dict[int, dict[str, str]] = {}
        self.quit = False

    def spawn_server(self, uid: int) -> int:
        pid = os.fork()
        if pid == 0:
            os.closerange(3, 4096)  # the listener and the client connection must not stay open here
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            while True:
                signal.pause()
        self.servers[pid] = uid
        self.server_pct[pid] = self.thread_pct
        self.server_mem[pid] = dict(self.mem_limits)
        return pid

    def reap(self) -> None:
        for pid in list(self.servers):
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    del self.servers[pid]
                    self.server_pct.pop(pid, None)
                    self.server_mem.pop(pid, None)

    def handle(self, line: str) -> str:
        self.reap()
        parts = line.split()
        if not parts:
            return ""
        cmd, args = parts[0], parts[1:]
        if cmd == "get_server_list":
            return "\n".join(str(p) for p in sorted(self.servers))
        if cmd == "start_server" and len(args) == 2 and args[0] == "-uid" and args[1].isdigit():
            uid = int(args[1])
            for pid, owner in self.servers.items():
                if owner == uid:
                    return str(pid)
            if self.servers:
                return f"Error: a server for another uid ({next(iter(self.servers.values()))}) is active"
            return str(self.spawn_server(uid))
        if cmd == "terminate_client" and len(args) == 2 and all(a.isdigit() for a in args):
            if int(args[0]) not in self.servers:
                return f"Error: no server with pid {args[0]}"
            return "0"
        if cmd == "set_default_active_thread_percentage" and len(args) == 1:
            value = _percentage(args[0])
            if value is None:
                return "Error: invalid percentage"
            self.thread_pct = value
            return ""
        if cmd == "get_default_active_thread_percentage" and not args:
            return f"{self.thread_pct:.1f}"
        if cmd == "set_default_device_pinned_mem_limit" and len(args) == 2:
            if not re.fullmatch(r"\d+[MG]", args[1]):
                return "Error: invalid limit"
            self.mem_limits[args[0]] = args[1]
            return ""
        if cmd == "get_default_device_pinned_mem_limit" and len(args) == 1:
            return self.mem_limits.get(args[0], "0")
        if cmd in ("set_active_thread_percentage", "get_active_thread_percentage", "set_device_pinned_mem_limit",
                   "get_device_pinned_mem_limit"):
            return self.server_command(cmd, args)
        if cmd == "quit" and not args:
            self.quit = True
            return ""
        return f"Error: unknown command {line!r}"


    def server_command(self, cmd: str, args: list[str]) -> str:
        """A running server's own limits (by server pid): they apply to the clients that connect
        to it from now on, not to those already connected."""
        if not args or not args[0].isdigit() or int(args[0]) not in self.servers:
            return f"Error: no server with pid {args[0] if args else ''}"
        pid = int(args[0])
        if cmd == "get_active_thread_percentage" and len(args) == 1:
            return f"{self.server_pct[pid]:.1f}"
        if cmd == "set_active_thread_percentage" and len(args) == 2:
            value = _percentage(args[1])
            if value is None:
                return "Error: invalid percentage"
            self.server_pct[pid] = value
            return ""
        if cmd == "get_device_pinned_mem_limit" and len(args) == 2:
            return self.server_mem[pid].get(args[1], "0")
        if cmd == "set_device_pinned_mem_limit" and len(args) == 3:
            if not re.fullmatch(r"\d+[MG]", args[2]):
                return "Error: invalid limit"
            self.server_mem[pid][args[1]] = args[2]
            return ""
        return f"Error: bad arguments to {cmd}"


def _percentage(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0 < value <= 100 else None


def serve(listener: socket.socket) -> None:
    state = State()
    while not state.quit:
        conn, _ = listener.accept()
        with conn:
            data = b""
            while chunk := conn.recv(4096):
                data += chunk
            line = data.decode().strip()
            reply = state.handle(line)
            log(f"{line} -> {reply!r}")
            conn.sendall(reply.encode())
    for pid in state.servers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    for path in (SOCK, PIDFILE):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    log("exit")


def daemonize() -> int:
    existing = None
    with contextlib.suppress(OSError, ValueError), open(PIDFILE) as f:
        existing = int(f.read().strip())
    if existing is not None:
        try:
            os.kill(existing, 0)
            print("An instance of this daemon is already running", file=sys.stderr)
            return 1
        except ProcessLookupError:
            pass
    os.makedirs(PIPE, exist_ok=True)
    os.makedirs(LOGDIR, exist_ok=True)
    r, w = os.pipe()
    if os.fork() > 0:
        os.close(w)
        ok = os.read(r, 1)
        return 0 if ok == b"1" else 1
    os.close(r)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(SOCK)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(SOCK)
    listener.listen(16)
    with open(PIDFILE, "w") as f:
        f.write(f"{os.getpid()}\n")
    log(f"started, pid {os.getpid()}, devices {os.environ.get('CUDA_VISIBLE_DEVICES', 'all')}")
    os.write(w, b"1")
    os.close(w)
    try:
        serve(listener)
    finally:
        os._exit(0)


def client() -> int:
    rc = 0
    for line in sys.stdin.read().splitlines():
        if not line.strip():
            continue
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(SOCK)
                s.sendall(line.encode())
                s.shutdown(socket.SHUT_WR)
                reply = b""
                while chunk := s.recv(4096):
                    reply += chunk
        except OSError:
            print("Cannot find MPS control daemon process", file=sys.stderr)
            return 1
        text = reply.decode()
        if text:
            print(text)
        if text.startswith("Error"):
            rc = 1
    return rc


if __name__ == "__main__":
    if sys.argv[1:] == ["-d"]:
        sys.exit(daemonize())
    if sys.argv[1:]:
        print(f"usage: {sys.argv[0]} [-d]", file=sys.stderr)
        sys.exit(2)
    sys.exit(client())
