"""A real Slurm cluster on one machine for tests: munged, slurmctld -D and three slurmd -D (n1-n3),
each node backed by its own `gpuschedd --mode slurm-node --sim ...` and configured by
`gpusched slurm export`.

Every daemon's pid is kept in BASE/pids/NAME (also across the restarts a relayout asks for, which
go through `python -m tests.integration.slurm_cluster restart ...`), and `stop()` ends each by pid.
Needs root (slurmd runs jobs as their users, mknod); Slurm and munge come from Debian
(`apt-get install slurm-wlm munge`; `make test` installs them when root, as it does systemd).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:  # this file also runs as a script (restart), where tests.conftest is not importable
    from tests.conftest import DaemonProcess

T = TypeVar("T")

# Why the cluster tests skip when not root (each test module's `pytestmark` reads these).
NOT_ROOT = os.geteuid() != 0
ROOT_REASON = "a Slurm cluster needs root (slurmd runs jobs as their users; simulated device files need mknod)"

INSTALL_HINT = "apt-get install -y --no-install-recommends slurm-wlm munge"
TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "sinfo", "scontrol", "squeue")
USER = "gpusched-slurm"  # the ordinary user jobs are submitted as (created if missing, removed after)
NODES = {
    "n1": {"sim": "A100-80GB:2", "toml": '[gpus.1]\nmig = ["3g.40gb", "2g.20gb", "2g.20gb"]\n'},
    "n2": {"sim": "H100-80GB:1", "toml": '[gpus.0]\nmig = ["1g.10gb", "4g.40gb"]\n'},
    # MPS on a whole GPU of its own node (gres/mps itself stays off: with it in GresTypes, Slurm 22.05
    # gives typed MIG requests zero devices; docs/slurm.md).
    "n3": {"sim": "H100-80GB:1", "toml": '[gpus.0]\nshare = "mps"\n'},
}


def missing_tools() -> list[str]:
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    return [t for t in TOOLS if shutil.which(t, path=path) is None]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[:1] != ["Z"]
    except OSError:
        return False


def stop_pid(pid: int, timeout: float = 15.0) -> None:
    """SIGTERM, then SIGKILL after `timeout`; returns once the process is gone (or a zombie)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            deadline += timeout
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.05)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def slurm_env(base: str) -> dict[str, str]:
    env = dict(os.environ)
    env["SLURM_CONF"] = f"{base}/etc/slurm.conf"
    env["PATH"] = env.get("PATH", "") + ":/usr/sbin:/sbin"
    return env


_STARTED: list[subprocess.Popen[bytes]] = []  # our children, reaped in Cluster.stop()


def spawn(base: str, name: str, argv: list[str], user: str | None = None) -> int:
    """Start a daemon in its own session, logging to BASE/log/NAME.out; its pid goes to BASE/pids/NAME."""
    with open(f"{base}/log/{name}.out", "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=slurm_env(base),
                                start_new_session=True, user=user, group=user, extra_groups=[] if user else None)
    Path(f"{base}/pids/{name}").write_text(str(proc.pid))
    _STARTED.append(proc)
    return proc.pid


def restart(base: str, name: str) -> None:
    """Stop the daemon NAME by its recorded pid and start it again the same way (for relayout)."""
    pid_file = Path(f"{base}/pids/{name}")
    stop_pid(int(pid_file.read_text()))
    spawn(base, name, daemon_argv(name))


def daemon_argv(name: str) -> list[str]:
    if name == "slurmctld":
        return ["slurmctld", "-D"]  # keeps its state: running and pending jobs survive the restart
    return ["slurmd", "-D", "-N", name.removeprefix("slurmd-")]


@dataclass
class Cluster:
    base: str
    gpuscheds: dict[str, DaemonProcess] = field(default_factory=dict)
    created_user: bool = False

    @property
    def env(self) -> dict[str, str]:
        return slurm_env(self.base)

    def run(self, *argv: str, user: str | None = None, check: bool = True, timeout: float = 30.0) -> str:
        done = subprocess.run(list(argv), capture_output=True, text=True, env=self.env, timeout=timeout,
                              cwd=f"{self.base}/jobs", user=user, group=user, extra_groups=[] if user else None,
                              check=False)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr}{done.stdout}\n"
                                 f"{self.logs()}")
        return done.stdout

    def gpusched(self, node: str, *args: str, check: bool = True,
                 timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        sock = self.gpuscheds[node].socket
        done = subprocess.run([sys.executable, "-m", "gpusched_cli.main", "--socket", sock, *args],
                              capture_output=True, text=True, env=self.env, timeout=timeout, check=False)
        if check and done.returncode != 0:
            raise AssertionError(f"gpusched {' '.join(args)} failed ({done.returncode}): {done.stderr}{done.stdout}"
                                 f"\n{self.logs()}")
        return done

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-N", "-h", "-o", "%N %T")
        return dict(line.split() for line in out.splitlines() if line.strip())

    def restart_command(self, name: str) -> str:
        """The command line relayout runs to restart daemon NAME (slurmd-n1, slurmctld)."""
        return f"{sys.executable} {__file__} restart {self.base} {name}"

    def logs(self) -> str:
        out = []
        for path in sorted(Path(self.base, "log").glob("*.log")):
            lines = [ln for ln in path.read_text(errors="replace").splitlines() if "pmix" not in ln]
            out.append(f"--- {path.name}\n" + "\n".join(lines[-15:]))
        return "\n".join(out)

    def stop(self) -> None:
        """Every daemon we started, by pid: slurmds, slurmctld, munged, then the gpuschedds."""
        pids = Path(self.base, "pids")
        # Jobs first: a job's slurmstepd outlives its slurmd, so it must end while Slurm can still end it.
        with contextlib.suppress(AssertionError, subprocess.SubprocessError, OSError):
            self.run("scancel", "--full", "--user", USER, check=False)
            wait_for(lambda: self.run("squeue", "-h", "-t", "all", "-o", "%i %T").count("RUNNING") == 0
                     and "COMPLETING" not in self.run("squeue", "-h", "-t", "all", "-o", "%T"), 30, "jobs to end")
        order = [*sorted(p.name for p in pids.glob("slurmd-*")), "slurmctld", "munged"]
        for name in order:
            with contextlib.suppress(FileNotFoundError, ValueError):
                stop_pid(int((pids / name).read_text()))
        for handle in self.gpuscheds.values():
            proc = handle.proc
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(30)
        # Job MPS control daemons the prologs started (an epilog that never ran would leave them).
        for pid_file in Path(self.base, "run").glob("*/mps/*/pipe/nvidia-cuda-mps-control.pid"):
            with contextlib.suppress(OSError, ValueError):
                stop_pid(int(pid_file.read_text()))
        while _STARTED:
            proc = _STARTED.pop()
            if proc.poll() is None:
                stop_pid(proc.pid)
            proc.wait(10)
        if self.created_user:
            subprocess.run(["userdel", USER], check=False, capture_output=True)


def ensure_user() -> bool:
    """An ordinary user for jobs; returns True when we created it (and so remove it after)."""
    try:
        pwd.getpwnam(USER)
        return False
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent", "--shell",
                        "/bin/sh", USER], check=True, capture_output=True)
        return True


def slurm_conf(base: str, ctld_port: int, nodes: list[str], gres_types: str) -> str:
    return f"""\
ClusterName=gpusched-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={base}/munge/munge.sock
CredType=cred/munge
StateSaveLocation={base}/state
SlurmdSpoolDir={base}/spool/%n
SlurmctldPidFile={base}/run/slurmctld.pid
SlurmdPidFile={base}/run/slurmd-%n.pid
SlurmctldLogFile={base}/log/slurmctld.log
SlurmdLogFile={base}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes={gres_types}
ReturnToService=2
MpiDefault=none
MailProg=/bin/true
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
Prolog={base}/etc/prolog
TaskProlog={base}/etc/task-prolog
Epilog={base}/etc/epilog
Include {base}/etc/nodes.conf
PartitionName=gpu Nodes={",".join(nodes)} Default=YES MaxTime=INFINITE State=UP
"""


def running_cluster(nodes: dict[str, dict[str, str]] | None = None, gres_types: str = "gpu"
                    ) -> Iterator[Cluster]:
    """The body of a module-scoped fixture: skip (fail under CI) when Slurm or munge is missing, start
    the cluster in a fresh short directory, and stop every daemon and remove it afterwards."""
    import pytest

    from tests.conftest import DaemonProcess, short_tmpdir

    missing = missing_tools()
    if missing:
        message = f"Slurm/munge not installed ({', '.join(missing)} missing): {INSTALL_HINT}"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; `make test` (host-tools) installs them as root")
        pytest.skip(message)
    base = short_tmpdir()
    made = Cluster(base)
    try:
        made = start_cluster(base, DaemonProcess, nodes, gres_types=gres_types)
        yield made
    finally:
        made.stop()
        shutil.rmtree(base, ignore_errors=True)


def start_cluster(base: str, daemon_process: type[DaemonProcess], nodes: dict[str, dict[str, str]] | None = None,
                  gres_types: str = "gpu", export_args: tuple[str, ...] = ()) -> Cluster:
    """Build and start the whole cluster under BASE (a short temporary directory, 0755): NODES by
    default, or `nodes` (name -> sim, toml and optional export flags) with `GresTypes=gres_types` and
    `export_args` for every export."""
    nodes = NODES if nodes is None else nodes
    cluster = Cluster(base)
    for sub in ("etc", "log", "pids", "run", "state", "jobs", "munge", *(f"spool/{n}" for n in nodes)):
        os.makedirs(f"{base}/{sub}", mode=0o755, exist_ok=True)
    os.chmod(f"{base}/jobs", 0o1777)  # job output, written by the job's user
    cluster.created_user = ensure_user()
    # munge: its own key and socket, run as the munge user.
    shutil.chown(f"{base}/munge", "munge", "munge")
    key = Path(f"{base}/munge/munge.key")
    key.write_bytes(os.urandom(1024))
    shutil.chown(key, "munge", "munge")
    key.chmod(0o400)
    spawn(base, "munged", ["munged", "-F", f"--socket={base}/munge/munge.sock", f"--key-file={key}",
                           f"--pid-file={base}/munge/munged.pid", f"--log-file={base}/munge/munged.log",
                           f"--seed-file={base}/munge/munged.seed"], user="munge")
    wait_for(lambda: os.path.exists(f"{base}/munge/munge.sock"), 15, "munged's socket")
    # gpuschedd per node, then its export into the shared gres.conf and nodes.conf.
    Path(f"{base}/etc/slurm.conf").write_text(slurm_conf(base, free_port(), list(nodes), gres_types))
    host = socket.gethostname()
    for node, spec in nodes.items():
        os.makedirs(f"{base}/gs-{node}", mode=0o755)  # its own directory: config, log and socket are named by it
        gs = daemon_process(f"{base}/gs-{node}/g.sock", f"{base}/gs-{node}/state", spec["sim"])
        gs.extra_config = (f'mode = "slurm-node"\n{spec["toml"]}[slurm]\nnode_name = "{node}"\n'
                           f'slurm_conf = "{base}/etc/slurm.conf"\n')
        cluster.gpuscheds[node] = gs
        gs.start()
        cluster.gpusched(node, "slurm", "export", "--node", node, "--out", f"{base}/{node}", "--node-params",
                         f"NodeAddr=127.0.0.1 NodeHostname={host} Port={free_port()} CPUs=2",
                         "--gres-conf", f"{base}/etc/gres.conf", "--slurm-conf", f"{base}/etc/nodes.conf",
                         "--run-dir", f"{base}/run/{node}", "--job-mapping-dir", f"{base}/dcgm/{node}",
                         *export_args, *spec.get("export", "").split())
    # One Prolog= for the cluster; both nodes share this host, so pick the node's own hook by name.
    for kind in ("prolog", "task-prolog", "epilog"):
        hook = Path(f"{base}/etc/{kind}")
        hook.write_text(f'#!/bin/sh\nexec "{base}/$SLURMD_NODENAME/hooks/{kind}"\n')
        hook.chmod(0o755)
    spawn(base, "slurmctld", [*daemon_argv("slurmctld"), "-i"])
    for node in nodes:
        spawn(base, f"slurmd-{node}", daemon_argv(f"slurmd-{node}"))
    wait_for(lambda: cluster.node_states() == dict.fromkeys(nodes, "idle"), 60, "every node idle in sinfo", cluster)
    return cluster


def wait_for(predicate: Callable[[], T], timeout: float, what: str, cluster: Cluster | None = None) -> T:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(AssertionError, subprocess.SubprocessError):
            value = predicate()
            if value:
                return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}\n"
                                 f"{cluster.logs() if cluster else ''}")
        time.sleep(0.1)


# ---- helpers for the tests ----


def sbatch(cluster: Cluster, *args: str, script: str) -> str:
    out = cluster.run("sbatch", "--parsable", "-o", f"{cluster.base}/jobs/%j.out", *args, "--wrap", script,
                      user=USER)
    return out.strip().split(";")[0]


def job_field(cluster: Cluster, job_id: str, name: str) -> str:
    text = cluster.run("scontrol", "show", "job", job_id, "--oneliner")
    m = re.search(rf"\b{name}=(\S*)", text)
    return m.group(1) if m else ""


def finished(cluster: Cluster, job_id: str, timeout: float = 30) -> str:
    wait_for(lambda: job_field(cluster, job_id, "JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"),
             timeout, f"job {job_id} to finish", cluster)
    return Path(cluster.base, "jobs", f"{job_id}.out").read_text()


def assert_no_prolog_trouble(cluster: Cluster) -> None:
    reasons = cluster.run("sinfo", "-R", "-h", "-o", "%N|%E")
    assert "rolog" not in reasons and "pilog" not in reasons, reasons


def sinfo_gres(cluster: Cluster) -> dict[str, set[str]]:
    out = cluster.run("sinfo", "-N", "-h", "-o", "%N %G")
    # Slurm lists a shared GRES once per GPU type, with :0 on types that offer none: those are not offers.
    return {node: {p.split("(")[0] for p in gres.split(",") if not p.split("(")[0].endswith(":0")}
            for node, gres in (ln.split() for ln in out.splitlines())}


if __name__ == "__main__":  # `restart BASE NAME`: what relayout runs to restart slurmd / slurmctld
    if len(sys.argv) != 4 or sys.argv[1] != "restart":
        sys.exit("usage: slurm_cluster.py restart BASE NAME")
    restart(sys.argv[2], sys.argv[3])
