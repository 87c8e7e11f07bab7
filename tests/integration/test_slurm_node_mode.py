"""`gpuschedd --mode slurm-node` without a Slurm cluster: its own queue is closed with a clear
message, and a Slurm that cannot be reached costs a log line, never the daemon (runs everywhere;
tests/integration/test_slurm_cluster.py has the real cluster)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

from tests.conftest import DaemonProcess, wait_until


def test_submit_is_refused_and_an_unreachable_slurm_is_logged_not_fatal(
    daemon_process: Callable[..., DaemonProcess],
) -> None:
    gs = daemon_process("H100-80GB:1")
    gs.extra_config = '[slurm]\nnode_name = "gpu07"\nscontrol = "/nonexistent/scontrol"\n'
    gs.start("--mode", "slurm-node")
    done = subprocess.run([sys.executable, "-m", "gpusched_cli.main", "--socket", gs.socket, "submit", "--gpus", "1",
                           "--", "true"], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "error: this node runs gpuschedd in slurm-node mode: Slurm owns the queue, gpusched only manages the GPUs",
        "hint: submit with Slurm instead, e.g. `sbatch --gres=gpu:1g.10gb:1 job.sh`",
    ]
    wait_until(lambda: "Slurm node state not checked: '/nonexistent/scontrol' not found" in gs.log(), timeout=15,
               what="the unreachable scontrol to be logged")
    assert "slurm-node mode: Slurm owns the queue; node gpu07 follows gpusched's GPU health" in gs.log()
    gpus = subprocess.run([sys.executable, "-m", "gpusched_cli.main", "--socket", gs.socket, "gpus"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert gpus.returncode == 0 and "H100" in gpus.stdout  # still serving
    assert gs.terminate() == 0


def test_jobs_queued_before_the_switch_to_slurm_node_mode_fail_instead_of_running(
        daemon_process: Callable[..., DaemonProcess]) -> None:
    """A job left pending or held when the node was switched to slurm-node mode started on GPUs Slurm
    hands out too (audit): one source of truth per GPU means they end, with the reason."""
    import json

    gs = daemon_process("H100-80GB:1")
    gs.extra_config = '[slurm]\nnode_name = "gpu07"\nscontrol = "/nonexistent/scontrol"\n'
    gs.start()

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "gpusched_cli.main", "--socket", gs.socket, *args],
                              capture_output=True, text=True, timeout=60, check=False)

    assert cli("submit", "--hold", "--gpus", "1", "--", "sleep", "30").returncode == 0
    assert gs.terminate() == 0
    gs.start("--mode", "slurm-node")
    job = json.loads(cli("show", "1", "--json").stdout)["job"]
    assert job["state"] == "FAILED" and "slurm-node mode" in job["reason"], job
    assert gs.terminate() == 0


def test_a_reload_keeps_the_layout_slurm_was_told_of(daemon_process: Callable[..., DaemonProcess]) -> None:
    """`slurm relayout` applies a layout and exports it to Slurm; a reload (or a restart) put the
    config's starting layout back, destroying instances Slurm's gres.conf names, under Slurm's jobs,
    which gpusched does not see as busy (audit)."""
    import json

    gs = daemon_process("H100-80GB:1")
    slurm = '[slurm]\nnode_name = "n2"\nscontrol = "/nonexistent/scontrol"\n'
    gs.extra_config = 'mode = "slurm-node"\n[gpus.0]\nmig = ["1g.10gb", "4g.40gb"]\n' + slurm
    gs.start()

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "gpusched_cli.main", "--socket", gs.socket, *args],
                              capture_output=True, text=True, timeout=60, check=False)

    def profiles() -> list[str]:
        gpus = json.loads(cli("gpus", "--json").stdout)["gpus"]
        return sorted(i["profile"] for g in gpus for i in g["instances"])

    assert profiles() == ["1g.10gb", "4g.40gb"]  # the starting layout
    assert cli("mig", "apply", "0", "3g.40gb,3g.40gb").returncode == 0  # what relayout does
    gs.write_config('mode = "slurm-node"\n[gpus.0]\nmig = ["1g.10gb", "4g.40gb"]\ninteractive = true\n' + slurm)
    reload = cli("admin", "reload")
    assert reload.returncode == 0 and "slurm relayout" in reload.stdout, reload.stdout
    assert profiles() == ["3g.40gb", "3g.40gb"]
    assert gs.terminate() == 0
