"""Shared fixtures: the real daemon, in-process on a temporary socket, and helpers to poll it.

The daemon runs on its own event loop in a background thread so that synchronous tests (the real
CLI through CliRunner, the blocking Client) talk to it over a real Unix socket, exactly as users do.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest

from gpusched.config import DaemonConfig
from gpusched.daemon import main as daemon_main
from gpusched.daemon.executor import kill_recorded_jobs
from gpusched.model import JobState
from gpusched_cli.client import Client

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.02, what: str = "") -> T:
    """Poll `predicate` until it returns something truthy; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


_SHORT_TMPDIRS: list[str] = []  # removed when the session ends (pytest_sessionfinish), whoever made them


def short_tmpdir() -> str:
    """AF_UNIX paths are limited to 108 bytes; pytest's tmp_path can be longer.

    Mode 0755 so that clients running as other uids (identity tests) can reach the socket. Removed at
    the end of the session, not of the test: a module's cluster may live in one across its tests.
    """
    path = tempfile.mkdtemp(prefix="gs-", dir="/tmp")
    os.chmod(path, 0o755)
    _SHORT_TMPDIRS.append(path)
    return path


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Every short_tmpdir the tests made, with what their daemons and jobs left in it (each fixture that
    starts a daemon has stopped it and killed its jobs by now)."""
    for path in _SHORT_TMPDIRS:
        shutil.rmtree(path, ignore_errors=True)


def inprocess_config(base: str, **overrides: Any) -> DaemonConfig:
    """A daemon's config under `base` (one simulated H100, no cgroups) for tests that start and stop
    `daemon_main.start` themselves, e.g. twice on the same state to look at a restart."""
    defaults: dict[str, Any] = {"sim": "H100-80GB:1", "cgroup_root": "off"}
    return DaemonConfig(socket=os.path.join(base, "g.sock"), state_dir=os.path.join(base, "state"),
                        **{**defaults, **overrides})


async def wait_running(engine: Any, job_id: int, timeout: float = 10.0, *,
                       until: Callable[[Any], bool] = lambda job: True) -> Any:
    """The job once the engine has it RUNNING with a pid (and `until` holds); fail after `timeout` s.
    For tests inside the daemon's own event loop, where wait_until would block it."""
    deadline = time.monotonic() + timeout
    while True:
        job = engine.get(job_id)
        if job is not None and job.state is JobState.RUNNING and job.pid and until(job):
            return job
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} not running after {timeout}s: {job.state if job else None}")
        await asyncio.sleep(0.025)


@dataclass
class DaemonHandle:
    """A daemon running in a background thread; `restart()` boots a fresh one on the same state."""

    socket: str
    state_dir: str
    sim: str
    overrides: dict[str, Any] = field(default_factory=dict)
    daemon: daemon_main.Daemon | None = None
    loop: asyncio.AbstractEventLoop | None = None
    thread: threading.Thread | None = None
    error: BaseException | None = None

    def start(self) -> DaemonHandle:
        ready = threading.Event()
        config = DaemonConfig(socket=self.socket, state_dir=self.state_dir, sim=self.sim, **self.overrides)

        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            try:
                self.daemon = await daemon_main.start(config)
            except BaseException as exc:
                self.error = exc
                ready.set()
                return
            ready.set()
            await self.daemon.stopped.wait()
            await daemon_main.stop(self.daemon)

        self.thread = threading.Thread(target=lambda: asyncio.run(main()), name="gpuschedd", daemon=True)
        self.thread.start()
        ready.wait(30)
        if self.error is not None:
            raise self.error
        return self

    def stop(self) -> None:
        if self.loop is not None and self.daemon is not None and self.thread is not None and self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.daemon.request_stop)
            self.thread.join(30)
            assert not self.thread.is_alive(), "daemon did not stop within 30 s"

    def restart(self) -> DaemonHandle:
        self.stop()
        self.daemon = None
        return self.start()

    def client(self) -> Client:
        return Client(self.socket)

    def call_in_loop(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the daemon's loop thread (to read engine state without racing it)."""
        assert self.loop is not None
        result: list[T] = []
        done = threading.Event()

        def run() -> None:
            result.append(fn())
            done.set()

        self.loop.call_soon_threadsafe(run)
        assert done.wait(10)
        return result[0]


def kill_job_processes(state_dir: str) -> None:
    """Tests must not leave jobs behind: SIGKILL every job process group recorded under state_dir,
    and every (simulated) MPS control daemon the daemon started there."""
    import glob

    for pid_file in glob.glob(os.path.join(state_dir, "mps", "**", "nvidia-cuda-mps-control.pid"), recursive=True):
        with contextlib.suppress(OSError, ValueError), open(pid_file) as f:
            os.kill(int(f.read().strip()), signal.SIGKILL)

    kill_recorded_jobs(state_dir)


@pytest.fixture
def daemon_factory() -> Iterator[Callable[..., DaemonHandle]]:
    handles: list[DaemonHandle] = []

    def make(sim: str = "H100-80GB:2", **overrides: Any) -> DaemonHandle:
        base = short_tmpdir()
        defaults = {"kill_grace_s": 2.0, "tick_s": 0.2, "allow_root_jobs": True, "cgroup_root": "off"}
        handle = DaemonHandle(socket=os.path.join(base, "g.sock"), state_dir=os.path.join(base, "state"),
                              sim=sim, overrides={**defaults, **overrides})
        handles.append(handle)
        return handle.start()

    yield make
    for handle in handles:
        handle.stop()
        kill_job_processes(handle.state_dir)
        shutil.rmtree(os.path.dirname(handle.socket), ignore_errors=True)


@pytest.fixture
def daemon(daemon_factory: Callable[..., DaemonHandle]) -> DaemonHandle:
    """A daemon on two simulated H100-80GB GPUs."""
    return daemon_factory()


@dataclass
class DaemonProcess:
    """The real `gpuschedd` program as a child process (for kill -9 and signal tests)."""

    socket: str
    state_dir: str
    sim: str
    proc: subprocess.Popen[bytes] | None = None
    log_path: str = ""
    extra_config: str = ""  # TOML appended to the generated config file

    @property
    def config_path(self) -> str:
        return os.path.join(os.path.dirname(self.socket), "gpusched.toml")

    def start(self, *extra: str) -> DaemonProcess:
        self.log_path = os.path.join(os.path.dirname(self.socket), "daemon.log")
        config = self.config_path
        self.write_config(self.extra_config)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it for its lifetime
        self.proc = subprocess.Popen(
            [*self.program(), "--config", config, "--sim", self.sim, "--socket", self.socket, "--state-dir",
             self.state_dir, *extra],
            stdout=log, stderr=log, start_new_session=True, env=self.environment(),
        )
        log.close()
        wait_until(self._answers, timeout=30, what=f"gpuschedd on {self.socket}")
        return self

    def program(self) -> list[str]:
        """How gpuschedd is run (a test may run it under a wrapper)."""
        return [sys.executable, "-m", "gpusched.daemon.main"]

    def environment(self) -> dict[str, str] | None:
        return None  # this process's

    def write_config(self, extra: str) -> None:
        """The generated config (tests run as root: let root submit, keep times short) plus `extra`."""
        with open(self.config_path, "w") as f:
            f.write('allow_root_jobs = true\nkill_grace_s = 2.0\ntick_s = 0.2\ncgroup_root = "off"\n' + extra)

    def _answers(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"gpuschedd exited with {self.proc.returncode}: {self.log()}")
        try:
            with Client(self.socket, timeout=5):
                return True
        except Exception:
            return False

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-4000:]

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def terminate(self) -> int:
        assert self.proc is not None
        self.proc.terminate()
        return self.proc.wait(30)


@pytest.fixture
def daemon_process() -> Iterator[Callable[..., DaemonProcess]]:
    made: list[DaemonProcess] = []

    def make(sim: str = "H100-80GB:2", cls: type[DaemonProcess] = DaemonProcess) -> DaemonProcess:
        base = short_tmpdir()
        proc = cls(os.path.join(base, "g.sock"), os.path.join(base, "state"), sim)
        made.append(proc)
        return proc

    yield make
    for proc in made:
        if proc.proc is not None and proc.proc.poll() is None:
            proc.proc.kill()
            proc.proc.wait(10)
        kill_job_processes(proc.state_dir)
        shutil.rmtree(os.path.dirname(proc.socket), ignore_errors=True)
