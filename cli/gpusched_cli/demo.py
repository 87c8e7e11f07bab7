"""`python -m gpusched_cli.demo` (`make demo`): the whole system end to end on simulated GPUs.

It runs the real programs as a user would — `gpuschedd` as a child process and every `gpusched`
command as its own process — so the demo exercises the socket, the protocol and the exit codes,
not a shortcut through Python calls. Every step checks its exit code; any surprise makes the demo
exit non-zero, so CI can run it too. It takes about 10 seconds.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpusched_cli.client import Client, DaemonUnavailable

SIM = "H100-80GB:3"  # GPUs 0 and 1 whole, GPU 2 split into MIG instances by the config
STARTUP_TIMEOUT_S = 20.0
WORK_TIMEOUT_S = 30.0


class DemoFailed(Exception):
    """A step did not do what the demo expects; the message says which and how."""


class Demo:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.socket = str(base / "g.sock")
        self.state_dir = str(base / "state")
        self.daemon_log = base / "gpuschedd.log"
        self.daemon: subprocess.Popen[bytes] | None = None
        self.t0 = time.monotonic()
        self.env = {**os.environ, "GPUSCHED_SOCKET": self.socket}
        self.step_no = 0

    # ---- output helpers --------------------------------------------------------------------------

    def heading(self, title: str) -> None:
        self.step_no += 1
        print(f"\n=== {self.step_no}. {title}  [t+{time.monotonic() - self.t0:.1f}s]", flush=True)

    def gpusched(self, *args: str, expect: int = 0) -> str:
        """Run the real CLI as a process; print the command and its output; check its exit code."""
        cmd = [sys.executable, "-m", "gpusched_cli.main", *args]
        print(f"$ gpusched {shlex.join(args)}", flush=True)
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60, check=False)
        output = proc.stdout + proc.stderr
        if output.strip():
            print(output.rstrip("\n"), flush=True)
        if proc.returncode != expect:
            raise DemoFailed(f"`gpusched {shlex.join(args)}` exited {proc.returncode}, expected {expect}:\n{output}")
        if expect != 0:
            print(f"(exit code {proc.returncode}, as expected)", flush=True)
        return proc.stdout

    # ---- steps -----------------------------------------------------------------------------------

    def start_daemon(self) -> None:
        self.heading(f"Start gpuschedd on simulated GPUs ({SIM})")
        config = self.base / "gpuschedd.toml"
        # The demo's jobs are harmless shell one-liners; a daemon started by root refuses root's jobs
        # unless told otherwise, which would make `sudo make demo` fail for no good reason.
        config.write_text(f"allow_root_jobs = {'true' if os.geteuid() == 0 else 'false'}\nkill_grace_s = 2.0\n"
                          'cgroup_root = "off"\n[gpus.2]\nmig = ["3g.40gb", "2g.20gb", "2g.20gb"]\n')
        argv = [sys.executable, "-m", "gpusched.daemon.main", "--sim", SIM, "--socket", self.socket,
                "--state-dir", self.state_dir, "--config", str(config)]
        print(f"$ gpuschedd --sim {SIM} --socket {self.socket} --state-dir {self.state_dir} --config {config}")
        with open(self.daemon_log, "wb") as log:
            self.daemon = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if self.daemon.poll() is not None:
                raise DemoFailed(f"gpuschedd exited with {self.daemon.returncode} while starting")
            try:
                with Client(self.socket, timeout=5) as client:
                    assert client.hello is not None
                    hello = client.hello
                    print(f"gpuschedd {hello['daemon_version']} answers on {self.socket} "
                          f"(protocol {hello['version']}, backend {hello['backend']})")
                    break
            except (DaemonUnavailable, OSError):
                pass
            if time.monotonic() > deadline:
                raise DemoFailed(f"gpuschedd did not answer on {self.socket} within {STARTUP_TIMEOUT_S:.0f}s")
            time.sleep(0.05)
        print(f"$ export GPUSCHED_SOCKET={self.socket}")

    def submit(self, *args: str, expect: int = 0) -> int | None:
        out = self.gpusched("submit", *args, expect=expect)
        words = out.split()
        return int(words[-1]) if out.startswith("Submitted job") else None

    def run(self) -> None:
        self.start_daemon()

        self.heading("The node's GPUs")
        self.gpusched("gpus")

        self.heading("Submit a small workload")
        self.submit("--name", "prep", "--gpus", "1", "--", "sh", "-c", "echo step 1; sleep 1; echo step 2")
        train = self.submit("--name", "train", "--gpus", "2", "--time", "5m", "--",
                            "sh", "-c", 'echo "training on $CUDA_VISIBLE_DEVICES"; sleep 2; echo done')
        self.submit("--name", "eval", "--gpus", "1", "--class", "interactive", "--",
                    "sh", "-c", "echo eval; sleep 1")
        self.submit("--name", "notebook", "--mig", "2g.20gb", "--", "sh", "-c",
                    "echo on $CUDA_VISIBLE_DEVICES; sleep 2")
        self.submit("--name", "finetune", "--mig", "3g.40gb", "--", "sh", "-c", "sleep 2")
        broken = self.submit("--name", "broken", "--gpus", "1", "--", "sh", "-c", "echo about to fail >&2; exit 3")
        self.submit("--name", "greedy", "--gpus", "3", "--", "true", expect=6)
        if train is None or broken is None:
            raise DemoFailed("could not read the job ids from `gpusched submit`")

        self.heading("A live picture: GPUs, MIG slices, running jobs, the queue by user")
        self.gpusched("top", "--once")

        self.heading("Watch the queue until every job has finished")
        deadline = time.monotonic() + WORK_TIMEOUT_S
        while True:
            print(f"[t+{time.monotonic() - self.t0:.1f}s]", flush=True)
            out = self.gpusched("queue")
            if out.strip() == "No jobs.":
                break
            if time.monotonic() > deadline:
                raise DemoFailed(f"jobs still unfinished after {WORK_TIMEOUT_S:.0f}s")
            time.sleep(1.0)
        self.gpusched("queue", "--all")

        self.heading(f"Everything about job {train}")
        self.gpusched("show", str(train))

        self.heading(f"The output of job {train}, and of the job that failed")
        self.gpusched("logs", str(train))
        self.gpusched("logs", str(broken))

        self.heading("submit --wait passes the job's exit code on")
        self.gpusched("submit", "--wait", "--gpus", "1", "--", "sh", "-c", "echo bye; exit 3", expect=3)

        self.heading("Who got what: service, share and waits")
        self.gpusched("stats", "--since", "10m")

        self.heading("Stop gpuschedd with SIGTERM")
        self.stop_daemon()

    def stop_daemon(self) -> None:
        assert self.daemon is not None
        print(f"$ kill -TERM {self.daemon.pid}")
        self.daemon.send_signal(signal.SIGTERM)
        try:
            code = self.daemon.wait(timeout=20)
        except subprocess.TimeoutExpired:
            raise DemoFailed("gpuschedd did not exit within 20s of SIGTERM") from None
        if code != 0:
            raise DemoFailed(f"gpuschedd exited with {code} after SIGTERM, expected 0")
        print("gpuschedd exited cleanly (0)")

    def cleanup(self) -> None:
        """Leave nothing behind after a failure or Ctrl-C too: cancel what still runs (a daemon that
        stops leaves its jobs running, to re-adopt them), then stop the daemon as `stop_daemon`
        does, and SIGKILL it only if it does not go."""
        if self.daemon is None or self.daemon.poll() is not None:
            return
        with contextlib.suppress(Exception), Client(self.socket, timeout=5) as client:
            jobs = client.request({"op": "queue", "all": False, "limit": 3000})["jobs"]
            ids = [int(j["id"]) for j in jobs]
            if ids:
                client.request({"op": "cancel", "job_ids": ids})
            deadline = time.monotonic() + 15
            while ids and client.request({"op": "queue", "all": False, "limit": 3000})["jobs"]:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        self.daemon.send_signal(signal.SIGTERM)
        try:
            self.daemon.wait(20)
        except subprocess.TimeoutExpired:
            self.daemon.kill()
            self.daemon.wait(10)

    def daemon_log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.daemon_log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no daemon log)"


def main() -> int:
    base = Path(tempfile.mkdtemp(prefix="gsdemo-", dir="/tmp"))  # AF_UNIX paths must stay short
    demo = Demo(base)
    try:
        demo.run()
    except KeyboardInterrupt:
        print("\ninterrupted: cancelling the demo's jobs and stopping gpuschedd", file=sys.stderr, flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            demo.cleanup()
        shutil.rmtree(base, ignore_errors=True)
        return 130
    except (DemoFailed, subprocess.TimeoutExpired) as exc:
        print(f"\ndemo failed: {exc}", file=sys.stderr)
        print(f"--- the end of the daemon's log ({demo.daemon_log}) ---", file=sys.stderr)
        print(demo.daemon_log_tail(), file=sys.stderr)
        return 1
    finally:
        demo.cleanup()
    shutil.rmtree(base, ignore_errors=True)
    print(f"\nDemo finished in {time.monotonic() - demo.t0:.1f}s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
