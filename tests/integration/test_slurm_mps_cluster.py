"""gres/mps and gres/shard under a real Slurm (issue 14): a cluster without MIG (Slurm 22.05 cannot
have mps or shard in GresTypes next to typed MIG GPUs, docs/slurm.md) of two nodes, each with an
H100 shared through MPS, offered as gres/mps (`export --gres-mps`, m1) or as four gres/shard
(`export --gres-shard 4`, m2). Two jobs of one user run on each GPU at once and share that user's
MPS control daemon, which stops when the last one ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration import slurm_cluster
from tests.integration.slurm_cluster import (
    USER,
    Cluster,
    assert_no_prolog_trouble,
    finished,
    job_field,
    sbatch,
    sinfo_gres,
    wait_for,
)

pytestmark = pytest.mark.skipif(slurm_cluster.NOT_ROOT, reason=slurm_cluster.ROOT_REASON)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    mps = '[gpus.0]\nshare = "mps"\n'
    yield from slurm_cluster.running_cluster({
        "m1": {"sim": "H100-80GB:1", "toml": mps, "export": "--gres-mps"},
        "m2": {"sim": "H100-80GB:1", "toml": mps, "export": "--gres-shard 4"},
    }, gres_types="gpu,mps,shard")


@pytest.mark.parametrize(("node", "gres", "offered"), [("m1", "mps:50", "mps:h100-80gb:100"),
                                                       ("m2", "shard:1", "shard:h100-80gb:4")])
def test_two_jobs_share_one_gpu_and_their_users_control_daemon(cluster: Cluster, node: str, gres: str,
                                                                offered: str) -> None:
    assert sinfo_gres(cluster)[node] == {"gpu:h100-80gb:1", offered}
    script = ('pid=$(cat "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid"); '
              'echo "pid=$pid pct=$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE cvd=$CUDA_VISIBLE_DEVICES"; '
              f'touch {cluster.base}/jobs/started-{node}-$SLURM_JOB_ID; '
              f'while [ $(ls {cluster.base}/jobs/started-{node}-* | wc -l) -lt 2 ]; do sleep 0.1; done')
    jobs = [sbatch(cluster, f"--gres={gres}", "--time=1", script=script) for _ in range(2)]
    outs = [finished(cluster, job, timeout=60) for job in jobs]  # each waits until both have started
    assert [job_field(cluster, job, "JobState") for job in jobs] == ["COMPLETED", "COMPLETED"], outs
    fields = [dict(p.split("=", 1) for p in out.split()) for out in outs]
    assert fields[0]["pid"] == fields[1]["pid"]
    assert fields[0]["pct"] == fields[1]["pct"] == ("50" if gres.startswith("mps") else "")  # Slurm sets it for mps
    assert fields[0]["cvd"] == fields[1]["cvd"] and fields[0]["cvd"].startswith("GPU-")
    pid = int(fields[0]["pid"])
    wait_for(lambda: not Path(f"/proc/{pid}").exists(), 15, f"MPS control daemon {pid} to stop", cluster)
    assert_no_prolog_trouble(cluster)
    assert job_field(cluster, jobs[0], "UserId").startswith(USER)
    assert {job_field(cluster, job, "NodeList") for job in jobs} == {node}
