"""MPS control: one `nvidia-cuda-mps-control -d` per device in `mps` share mode.

One daemon per device (GPU or MIG instance), each with its own CUDA_MPS_PIPE_DIRECTORY and
CUDA_MPS_LOG_DIRECTORY, so a fault on one device cannot block clients of another (reference §4).
We speak the control program's stdin protocol, exactly as an operator would (`echo CMD |
nvidia-cuda-mps-control`). Calls block (the daemon runs them off its event loop) but every one has a
timeout, and failures become GpuError with the control log in the hint.

A control daemon serves one user at a time (servers of different uids are serialized), so each
`MpsDaemon` tracks the uid of its current clients and refuses a second uid until they are gone.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from gpusched.gpu.backend import GpuBusyError, GpuError

DEFAULT_CONTROL_BINARY = "nvidia-cuda-mps-control"

PID_FILE = "nvidia-cuda-mps-control.pid"
_POLL_S = 0.02


def mps_client_env(
    pipe_dir: str | os.PathLike[str], thread_percentage: int | None, mem_limit_mib: int | None, ordinal: int = 0
) -> dict[str, str]:
    """Environment for one MPS client (job). Client values can only lower the daemon's defaults.

    `ordinal` is the device as the client sees it: 0 when CUDA_VISIBLE_DEVICES names one device.
    """
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)}
    if thread_percentage is not None:
        if not 1 <= thread_percentage <= 100:
            raise ValueError(f"thread percentage must be 1..100, got {thread_percentage}")
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(thread_percentage)
    if mem_limit_mib is not None:
        if mem_limit_mib < 1:
            raise ValueError(f"pinned memory limit must be >= 1 MiB, got {mem_limit_mib}")
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"{ordinal}={mem_limit_mib}M"
    return env


def daemon_dir(base_dir: str | os.PathLike[str], device: str, uid: int | None) -> Path:
    """Where the control daemon of a device (and user) keeps its pipe and log directories: a name
    derived from both, so a restarted gpuschedd finds the daemons its predecessor started."""
    # Short directory names: the pipe directory holds Unix sockets (108-byte path limit).
    label = device if uid is None else f"{device}:{uid}"
    return Path(base_dir) / hashlib.sha1(label.encode()).hexdigest()[:12]


def _pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (an exited daemon awaiting its reaper)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no procfs: trust kill(0)
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


class MpsDaemon:
    """One MPS control daemon bound to one device UUID, and optionally to one user.

    Per-user daemons (`uid` set) are NVIDIA's "provisioning MPS on a per-user basis": each user's
    clients get their own control daemon, server and pipe directory on the device, so two users'
    shares can be on one GPU at once. Their servers are separate GPU contexts: a fatal fault in
    one user's server cannot take the other's clients down, but the two servers time-slice rather
    than run kernels side by side (docs/gpu.md, "MPS").
    """

    def __init__(
        self,
        device: str,
        base_dir: str | os.PathLike[str],
        *,
        uid: int | None = None,
        control_binary: str = DEFAULT_CONTROL_BINARY,
        timeout_s: float = 10.0,
    ) -> None:
        self.device = device
        self.uid = uid
        self.root = daemon_dir(base_dir, device, uid)
        self.pipe_dir = self.root / "pipe"
        self.log_dir = self.root / "log"
        self.control_binary = control_binary
        self.timeout_s = timeout_s
        self.owner_uid: int | None = None
        self._clients: dict[int, int] = {}  # client pid -> uid
        self._lock = threading.Lock()

    @classmethod
    def found_at(cls, root: Path, *, control_binary: str = DEFAULT_CONTROL_BINARY,
                 timeout_s: float = 10.0) -> MpsDaemon:
        """The daemon whose directories are `root`, device unknown (it can still be told to quit)."""
        found = cls("", root.parent, control_binary=control_binary, timeout_s=timeout_s)
        found.root, found.pipe_dir, found.log_dir = root, root / "pipe", root / "log"
        return found

    @property
    def control_log(self) -> Path:
        return self.log_dir / "control.log"

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(self.pipe_dir)
        env["CUDA_MPS_LOG_DIRECTORY"] = str(self.log_dir)
        env["CUDA_VISIBLE_DEVICES"] = self.device
        return env

    def _error(self, message: str) -> GpuError:
        return GpuError(f"MPS control for {self.device}: {message}", hint=f"see {self.control_log}")

    def _run(self, args: list[str], stdin: str | None) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                [*self._argv(), *args],
                input=stdin,
                capture_output=True,
                text=True,
                env=self._env(),
                timeout=self.timeout_s,
                check=False,
            )
        except FileNotFoundError:
            raise GpuError(
                f"MPS control program {self.control_binary!r} not found",
                hint="install the CUDA MPS tools or set the control binary path in the config",
            ) from None
        except subprocess.TimeoutExpired:
            raise self._error(f"`{' '.join(args) or stdin}` timed out after {self.timeout_s:g}s") from None
        except OSError as exc:  # not executable, a directory, ...: the share fails, the daemon goes on
            raise GpuError(
                f"MPS control program {self.control_binary!r} cannot be run: {exc.strerror or exc}",
                hint="check the file's permissions, or set the control binary path in the config",
            ) from None

    def _argv(self) -> list[str]:
        """A Python control program (the simulator) runs under this interpreter, so it needs no exec
        bit (an install may drop it) and, isolated (-I), nothing from the caller's paths."""
        if self.control_binary.endswith(".py"):
            return [sys.executable, "-I", self.control_binary]
        return [self.control_binary]

    # ------------------------------------------------------------------ lifecycle

    def pid(self) -> int | None:
        """The control daemon's pid from its pid file, if that process is alive."""
        try:
            pid = int((self.pipe_dir / PID_FILE).read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if _pid_alive(pid) else None

    def running(self) -> bool:
        return self.pid() is not None

    def start(self, *, default_thread_percentage: int | None = None, pinned_mem_limit_mib: int | None = None) -> None:
        """Start the daemon (`-d`), wait for its pid file, then set the defaults for future servers."""
        if not self.running():
            self.pipe_dir.mkdir(parents=True, exist_ok=True)
            self.log_dir.mkdir(parents=True, exist_ok=True)
            result = self._run(["-d"], None)
            if result.returncode != 0:
                raise self._error(f"`-d` failed ({result.returncode}): {(result.stderr or result.stdout).strip()}")
            deadline = time.monotonic() + self.timeout_s
            while not self.running():
                if time.monotonic() > deadline:
                    raise self._error(f"daemon wrote no live {PID_FILE} within {self.timeout_s:g}s")
                time.sleep(_POLL_S)
        if default_thread_percentage is not None:
            self.set_default_active_thread_percentage(default_thread_percentage)
        if pinned_mem_limit_mib is not None:
            self.set_default_device_pinned_mem_limit(self.device, pinned_mem_limit_mib)

    def stop(self) -> None:
        """`quit`, then wait until the daemon process is gone."""
        pid = self.pid()
        if pid is None:
            return
        self.command("quit")
        deadline = time.monotonic() + self.timeout_s
        while _pid_alive(pid):
            if time.monotonic() > deadline:
                raise self._error(f"daemon {pid} still running {self.timeout_s:g}s after quit")
            time.sleep(_POLL_S)
        with self._lock:
            self._clients.clear()
            self.owner_uid = None

    # ------------------------------------------------------------------ commands

    def command(self, line: str) -> str:
        """Send one control command on stdin; return its reply."""
        return self.commands([line])

    def commands(self, lines: list[str]) -> str:
        """Send control commands in one run of the control program (one line each, as an operator
        would pipe them); return the replies. Any reply that is an error fails the lot."""
        if any("\n" in line for line in lines):
            raise ValueError("one command per line")
        result = self._run([], "".join(line + "\n" for line in lines))
        out = result.stdout.strip()
        bad = [reply for reply in out.splitlines() if reply.strip().lower().startswith("error")]
        if result.returncode != 0 or bad:
            what = lines[0] if len(lines) == 1 else "; ".join(lines)
            said = result.stderr.strip() or "; ".join(bad) or out
            raise self._error(f"`{what}` failed ({result.returncode}): {said}")
        return out

    def set_default_active_thread_percentage(self, percentage: int) -> None:
        if not 1 <= percentage <= 100:
            raise ValueError(f"thread percentage must be 1..100, got {percentage}")
        self.command(f"set_default_active_thread_percentage {percentage}")

    def set_default_device_pinned_mem_limit(self, device: str | int, mib: int) -> None:
        if mib < 1:
            raise ValueError(f"pinned memory limit must be >= 1 MiB, got {mib}")
        self.command(f"set_default_device_pinned_mem_limit {device} {mib}M")

    def set_caps(self, thread_percentage: int, mem_limit_mib: int | None) -> None:
        """The most SMs and memory any one client of this daemon may take: the defaults of servers
        yet to start, and the limits of each running server for the clients that connect from now
        on. A client's own CUDA_MPS_* variables can only lower them (reference §4), so a job that
        starts itself with higher values gets these, not more."""
        if not 1 <= thread_percentage <= 100:
            raise ValueError(f"thread percentage must be 1..100, got {thread_percentage}")
        if mem_limit_mib is not None and mem_limit_mib < 1:
            raise ValueError(f"pinned memory limit must be >= 1 MiB, got {mem_limit_mib}")
        lines = [f"set_default_active_thread_percentage {thread_percentage}"]
        if mem_limit_mib is not None:
            lines.append(f"set_default_device_pinned_mem_limit {self.device} {mem_limit_mib}M")
        for server in self.server_list():
            lines.append(f"set_active_thread_percentage {server} {thread_percentage}")
            if mem_limit_mib is not None:
                lines.append(f"set_device_pinned_mem_limit {server} {self.device} {mem_limit_mib}M")
        self.commands(lines)

    def server_list(self) -> list[int]:
        """PIDs of the MPS servers this daemon runs (one per active uid)."""
        out = self.command("get_server_list")
        return [int(tok) for tok in re.findall(r"\d+", out)]

    def terminate_client(self, server_pid: int, client_pid: int) -> None:
        """Kill one client's contexts without disturbing the others (call before signalling it)."""
        out = self.command(f"terminate_client {server_pid} {client_pid}")
        if out not in ("", "0"):
            raise self._error(f"terminate_client {server_pid} {client_pid} answered {out!r}")

    # ------------------------------------------------------------------ clients and owner

    def client_env(self, thread_percentage: int | None, mem_limit_mib: int | None) -> dict[str, str]:
        """The env a job needs to be a client of this daemon (plus CUDA_VISIBLE_DEVICES from the allocation)."""
        return mps_client_env(self.pipe_dir, thread_percentage, mem_limit_mib)

    def can_serve(self, uid: int) -> bool:
        with self._lock:
            return self.owner_uid is None or self.owner_uid == uid

    def acquire(self, uid: int, pid: int) -> None:
        """Record a client; a different uid than the current owner's is refused (one uid per server)."""
        with self._lock:
            if self.owner_uid is not None and self.owner_uid != uid:
                raise GpuBusyError(f"MPS on {self.device} is serving uid {self.owner_uid}; uid {uid} must wait")
            self.owner_uid = uid
            self._clients[pid] = uid

    def release(self, pid: int) -> None:
        """A client exited; with no clients left the device is free for any uid."""
        with self._lock:
            self._clients.pop(pid, None)
            if not self._clients:
                self.owner_uid = None

    def clients(self) -> dict[int, int]:
        with self._lock:
            return dict(self._clients)
