"""gpusched under a real Slurm cluster on this machine (issue 14): munged, slurmctld and two slurmd,
each node backed by its own `gpuschedd --mode slurm-node --sim` (n1: two A100-80GB, GPU 0 whole and
shared through MPS, GPU 1 in MIG mode; n2: one H100-80GB in MIG mode). The cluster starts once
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
    mps: dict[str, int] = {}
    for gpu in gpus["gpus"]:  # type: ignore[attr-defined]
        if gpu["mig_enabled"]:
            for inst in gpu["instances"]:
                counts[inst["profile"]] = counts.get(inst["profile"], 0) + 1
        else:
            key = gpu["model"].lower()
            counts[key] = counts.get(key, 0) + 1
            if gpu["share"] == "mps":
                mps[key] = mps.get(key, 0) + 100
    return {f"gpu:{t}:{n}" for t, n in counts.items()} | {f"mps:{t}:{n}" for t, n in mps.items()}


def sinfo_gres(cluster: Cluster) -> dict[str, set[str]]:
    out = cluster.run("sinfo", "-N", "-h", "-o", "%N %G")
    # Slurm lists a shared GRES once per GPU type, with :0 on types that offer none: those are not offers.
    return {node: {p.split("(")[0] for p in gres.split(",") if not p.split("(")[0].endswith(":0")}
            for node, gres in (ln.split() for ln in out.splitlines())}


def test_sinfo_gres_match_gpusched_layout(cluster: Cluster) -> None:
    seen = sinfo_gres(cluster)
    for node in ("n1", "n2"):
        assert seen[node] == expected_gres(inventory(cluster, node)), (node, seen)
    assert seen["n1"] == {"gpu:3g.40gb:1", "gpu:2g.20gb:2", "gpu:a100-80gb:1", "mps:a100-80gb:100"}
    assert_no_prolog_trouble(cluster)
