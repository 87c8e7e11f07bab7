"""gpusched under a real Slurm cluster on this machine (issue 14): munged, slurmctld and two slurmd,
each node backed by its own `gpuschedd --mode slurm-node --sim` (n1: two A100-80GB, GPU 0 whole,
GPU 1 in MIG mode; n2: one H100-80GB in MIG mode; n3: one H100-80GB shared through MPS). The cluster starts once
for the module; the tests run in file order and leave it as they found it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import DaemonProcess, short_tmpdir
from tests.integration import slurm_cluster
from tests.integration.slurm_cluster import USER, Cluster, wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a Slurm cluster needs root (slurmd runs jobs as "
                                "their users; simulated device files need mknod)")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    missing = slurm_cluster.missing_tools()
    if missing:
        message = f"Slurm/munge not installed ({', '.join(missing)} missing): {slurm_cluster.INSTALL_HINT}"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; `make test` (host-tools) installs them as root")
        pytest.skip(message)
    base = short_tmpdir()
    made = Cluster(base)
    try:
        made = slurm_cluster.start_cluster(base, DaemonProcess)
        yield made
        made.run("scancel", "-u", USER, check=False)
    finally:
        made.stop()
        shutil.rmtree(base, ignore_errors=True)


def inventory(cluster: Cluster, node: str) -> dict[str, object]:
    return json.loads(cluster.gpusched(node, "gpus", "--json").stdout)  # type: ignore[no-any-return]


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


def expected_gres(gpus: dict[str, object]) -> set[str]:
    """What the daemon's inventory says Slurm should offer, counted here from `gpus --json`."""
    counts: dict[str, int] = {}
    for gpu in gpus["gpus"]:  # type: ignore[attr-defined]
        if gpu["mig_enabled"]:
            for inst in gpu["instances"]:
                counts[inst["profile"]] = counts.get(inst["profile"], 0) + 1
        else:
            key = gpu["model"].lower()
            counts[key] = counts.get(key, 0) + 1
    return {f"gpu:{t}:{n}" for t, n in counts.items()}


def sinfo_gres(cluster: Cluster) -> dict[str, set[str]]:
    out = cluster.run("sinfo", "-N", "-h", "-o", "%N %G")
    # Slurm lists a shared GRES once per GPU type, with :0 on types that offer none: those are not offers.
    return {node: {p.split("(")[0] for p in gres.split(",") if not p.split("(")[0].endswith(":0")}
            for node, gres in (ln.split() for ln in out.splitlines())}


def test_sinfo_gres_match_gpusched_layout(cluster: Cluster) -> None:
    seen = sinfo_gres(cluster)
    for node in ("n1", "n2", "n3"):
        assert seen[node] == expected_gres(inventory(cluster, node)), (node, seen)
    assert seen["n1"] == {"gpu:3g.40gb:1", "gpu:2g.20gb:2", "gpu:a100-80gb:1"}
    assert seen["n3"] == {"gpu:h100-80gb:1"}
    assert_no_prolog_trouble(cluster)


def instance_uuid(cluster: Cluster, node: str, profile: str) -> set[str]:
    gpus = inventory(cluster, node)["gpus"]
    return {i["uuid"] for g in gpus for i in g["instances"] if i["profile"] == profile}  # type: ignore[attr-defined]


def test_mig_job_as_ordinary_user_lands_on_the_right_node_and_sees_its_mig_uuid(cluster: Cluster) -> None:
    job = sbatch(cluster, "--gres=gpu:3g.40gb:1",
                 script='echo "node=$SLURMD_NODENAME user=$(id -un) cvd=$CUDA_VISIBLE_DEVICES"')
    out = finished(cluster, job)
    assert job_field(cluster, job, "JobState") == "COMPLETED", out
    fields = dict(p.split("=", 1) for p in out.split())
    assert fields["node"] == "n1" and fields["user"] == USER  # only n1 has a 3g.40gb
    assert fields["cvd"].startswith("MIG-") and {fields["cvd"]} == instance_uuid(cluster, "n1", "3g.40gb")
    assert_no_prolog_trouble(cluster)


def test_srun_spans_both_nodes_each_task_seeing_its_own_nodes_gpu(cluster: Cluster) -> None:
    out = cluster.run("srun", "-N2", "-w", "n1,n2", "--ntasks-per-node=1", "--gres=gpu:1", "-l", "sh", "-c",
                      'echo "$SLURMD_NODENAME $CUDA_VISIBLE_DEVICES"', user=USER, timeout=60)
    seen = dict(line.split(": ", 1)[1].split() for line in out.splitlines() if ": " in line)
    assert set(seen) == {"n1", "n2"}, out
    for node, uuid in seen.items():
        gpus = inventory(cluster, node)["gpus"]
        known = {g["uuid"] for g in gpus} | {i["uuid"] for g in gpus for i in g["instances"]}  # type: ignore[attr-defined]
        assert uuid in known, (node, uuid, known)
    assert_no_prolog_trouble(cluster)


def test_mps_job_starts_and_stops_its_control_daemon(cluster: Cluster) -> None:
    job = sbatch(cluster, "--gres=gpu:h100-80gb:1", script=(
        'pid=$(cat "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid"); '
        'test -d /proc/$pid && echo "alive=$pid cvd=$CUDA_VISIBLE_DEVICES node=$SLURMD_NODENAME"'))
    out = finished(cluster, job)
    assert job_field(cluster, job, "JobState") == "COMPLETED", out
    fields = dict(p.split("=", 1) for p in out.split())
    whole = [g for g in inventory(cluster, "n3")["gpus"] if g["share"] == "mps"]  # type: ignore[attr-defined]
    assert fields["cvd"] == whole[0]["uuid"] and fields["node"] == "n3"
    pid = int(fields["alive"])
    wait_for(lambda: not os.path.exists(f"/proc/{pid}"), 15, f"MPS control daemon {pid} to stop after the job", cluster)
    assert_no_prolog_trouble(cluster)
