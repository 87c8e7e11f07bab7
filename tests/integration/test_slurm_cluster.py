"""gpusched under a real Slurm cluster on this machine (issue 14): munged, slurmctld and three slurmd,
each node backed by its own `gpuschedd --mode slurm-node --sim` (n1: two A100-80GB, GPU 0 whole,
GPU 1 in MIG mode; n2: one H100-80GB in MIG mode; n3: one H100-80GB shared through MPS). The cluster
starts once for the module; the tests run in file order, and each ends the jobs it started.
"""

from __future__ import annotations

import json
import os
import re
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
    yield from slurm_cluster.running_cluster()


def inventory(cluster: Cluster, node: str) -> dict[str, object]:
    return json.loads(cluster.gpusched(node, "gpus", "--json").stdout)  # type: ignore[no-any-return]


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
    dcgm = Path(cluster.base, "dcgm", "n1")
    job = sbatch(cluster, "--gres=gpu:3g.40gb:1", script=(
        'echo "node=$SLURMD_NODENAME user=$(id -un) cvd=$CUDA_VISIBLE_DEVICES '
        f'dcgm=$(cd {dcgm} && grep -lx "$SLURM_JOB_ID" *)"'))
    out = finished(cluster, job)
    assert job_field(cluster, job, "JobState") == "COMPLETED", out
    fields = dict(p.split("=", 1) for p in out.split())
    assert fields["node"] == "n1" and fields["user"] == USER  # only n1 has a 3g.40gb
    assert fields["cvd"].startswith("MIG-") and {fields["cvd"]} == instance_uuid(cluster, "n1", "3g.40gb")
    gpus = inventory(cluster, "n1")["gpus"]
    gi = next(i["gi_id"] for g in gpus for i in g["instances"] if i["uuid"] == fields["cvd"])  # type: ignore[attr-defined]
    assert fields["dcgm"] == f"1.{gi}"  # dcgm-exporter's job-mapping file for GPU 1, GPU instance gi
    wait_for(lambda: not list(dcgm.iterdir()), 15, "the Epilog to clear the job mapping", cluster)
    assert_no_prolog_trouble(cluster)


def test_a_prolog_problem_reaches_the_job_and_never_drains_the_node(cluster: Cluster) -> None:
    gres_map = Path(cluster.base, "n1", "gres-map.json")
    saved = gres_map.read_text()
    gres_map.write_text(json.dumps({"node": "n1", "gpus": []}))  # as if the export were stale
    try:
        job = sbatch(cluster, "--gres=gpu:a100-80gb:1", script='echo "cvd=[$CUDA_VISIBLE_DEVICES]"')
        out = finished(cluster, job)
    finally:
        gres_map.write_text(saved)
    assert "gpusched prolog on n1: GRES index 0 is not in" in out and "no GPU is visible to this job" in out, out
    assert "cvd=[]" in out  # no GPU rather than a wrong one
    assert job_field(cluster, job, "JobState") == "COMPLETED" and not_drained(cluster, "n1")
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


def test_relayout_makes_a_pending_mig_job_runnable_while_the_other_node_keeps_running(cluster: Cluster) -> None:
    long_job = sbatch(cluster, "--gres=gpu:1g.10gb:1", script="sleep 300")  # n2's only 1g.10gb
    wait_for(lambda: job_field(cluster, long_job, "JobState") == "RUNNING", 30, "the n2 job to run", cluster)
    assert job_field(cluster, long_job, "NodeList") == "n2"
    pending = sbatch(cluster, "--gres=gpu:1g.10gb:1", script='echo "node=$SLURMD_NODENAME cvd=$CUDA_VISIBLE_DEVICES"')
    wait_for(lambda: job_field(cluster, pending, "Reason") == "Resources", 30, "the MIG job to pend", cluster)
    done = cluster.gpusched(
        "n1", "slurm", "relayout", "n1", "1=3g.40gb,2g.20gb,1g.10gb,1g.10gb", "--out", f"{cluster.base}/n1",
        "--restart-slurmd", cluster.restart_command("slurmd-n1"), "--reconfigure", cluster.restart_command("slurmctld"),
        "--timeout", "60", timeout=120)
    assert "resumed n1" in done.stdout, done.stdout
    out = finished(cluster, pending, timeout=60)
    fields = dict(p.split("=", 1) for p in out.split())
    assert fields["node"] == "n1" and fields["cvd"] in instance_uuid(cluster, "n1", "1g.10gb"), out
    assert job_field(cluster, long_job, "JobState") == "RUNNING"  # the other node's job never noticed
    assert sinfo_gres(cluster)["n1"] == expected_gres(inventory(cluster, "n1"))
    cluster.run("scancel", long_job)
    wait_for(lambda: job_field(cluster, long_job, "JobState") == "CANCELLED", 30, "the n2 job to end", cluster)
    assert_no_prolog_trouble(cluster)


def relayout_args(cluster: Cluster, node: str) -> list[str]:
    return ["--out", f"{cluster.base}/{node}", "--restart-slurmd", cluster.restart_command(f"slurmd-{node}"),
            "--reconfigure", cluster.restart_command("slurmctld"), "--timeout", "60"]


def test_relayout_auto_plans_the_layout_from_slurms_pending_mig_jobs(cluster: Cluster) -> None:
    idle = cluster.gpusched("n1", "slurm", "relayout", "n1", "--auto", *relayout_args(cluster, "n1"))
    assert "no pending MIG job a new layout would help; nothing changed" in idle.stdout
    long_job = sbatch(cluster, "--gres=gpu:4g.40gb:1", script="sleep 300")  # n2's only 4g.40gb
    wait_for(lambda: job_field(cluster, long_job, "JobState") == "RUNNING", 30, "the n2 job to run", cluster)
    pending = sbatch(cluster, "--gres=gpu:4g.40gb:1", script='echo "node=$SLURMD_NODENAME cvd=$CUDA_VISIBLE_DEVICES"')
    wait_for(lambda: job_field(cluster, pending, "Reason") == "Resources", 30, "the 4g job to pend", cluster)
    assert not instance_uuid(cluster, "n1", "4g.40gb")
    done = cluster.gpusched("n1", "slurm", "relayout", "n1", "--auto", *relayout_args(cluster, "n1"), timeout=120)
    assert "planned layout: 1=" in done.stdout and "4g.40gb" in done.stdout and "resumed n1" in done.stdout, done
    out = finished(cluster, pending, timeout=60)
    fields = dict(p.split("=", 1) for p in out.split())
    assert fields["node"] == "n1" and {fields["cvd"]} == instance_uuid(cluster, "n1", "4g.40gb"), out
    assert job_field(cluster, long_job, "JobState") == "RUNNING"
    cluster.run("scancel", long_job)
    wait_for(lambda: job_field(cluster, long_job, "JobState") == "CANCELLED", 30, "the n2 job to end", cluster)


def test_relayout_never_touches_a_node_whose_gpus_are_busy(cluster: Cluster) -> None:
    busy = sbatch(cluster, "--gres=gpu:3g.40gb:1", script="sleep 300")
    wait_for(lambda: job_field(cluster, busy, "JobState") == "RUNNING", 30, "the n1 job to run", cluster)
    before = inventory(cluster, "n1")
    done = cluster.gpusched("n1", "slurm", "relayout", "n1", "1=7g.80gb", "--out", f"{cluster.base}/n1",
                            "--restart-slurmd", "false", "--reconfigure", "false", "--timeout", "2", check=False)
    assert done.returncode == 1 and "the end of its GPU jobs did not happen within 2s" in done.stderr, done
    assert "nothing changed, n1 resumed" in done.stderr
    assert inventory(cluster, "n1") == before  # every instance kept, same UUIDs
    assert not_drained(cluster, "n1") and job_field(cluster, busy, "JobState") == "RUNNING"
    cluster.run("scancel", busy)
    wait_for(lambda: job_field(cluster, busy, "JobState") == "CANCELLED", 30, "the n1 job to end", cluster)


def node_reason(cluster: Cluster, node: str) -> tuple[str, str]:
    text = cluster.run("scontrol", "show", "node", node, "--oneliner")
    state = re.search(r"\bState=(\S+)", text)
    reason = re.search(r"\bReason=(.*?)(?: \[[^]]*\])?\s*$", text)
    return (state.group(1) if state else "", reason.group(1) if reason else "")


def not_drained(cluster: Cluster, node: str) -> bool:
    """In service. Flags such as NOT_RESPONDING (a slurmd restarted by a relayout) are Slurm's own."""
    return "DRAIN" not in node_reason(cluster, node)[0].split("+")


def test_an_injected_xid_drains_the_node_with_the_reason_and_gpus_resume_resumes_it(cluster: Cluster) -> None:
    cluster.gpusched("n2", "sim", "inject-xid", "0", "79")
    state, reason = wait_for(lambda: (s := node_reason(cluster, "n2"))[0].endswith("DRAIN") and s, 30,
                             "n2 to drain in Slurm", cluster)
    assert reason == "gpusched: XID 79 on GPU 0", (state, reason)
    assert not_drained(cluster, "n1")
    cluster.gpusched("n2", "gpus", "resume", "0")
    wait_for(lambda: not_drained(cluster, "n2") and node_reason(cluster, "n2")[1] == "", 30,
             "n2 to be resumed in Slurm", cluster)


def test_a_lost_gpu_drains_its_node_and_an_administrators_drain_is_never_undone(cluster: Cluster) -> None:
    cluster.run("scontrol", "update", "nodename=n1", "state=drain", "reason=admin: new fans")
    cluster.gpusched("n3", "sim", "inject-xid", "0", "79", "--lost")
    state, reason = wait_for(lambda: (s := node_reason(cluster, "n3"))[0].endswith("DRAIN") and s, 30,
                             "n3 to drain in Slurm", cluster)
    assert reason.startswith("gpusched: GPU 0 stopped answering (XID 79)"), reason
    # n1's gpuschedd has checked by now too (every 2 s; n3 took longer): it left the admin's drain alone.
    state, reason = node_reason(cluster, "n1")
    assert "DRAIN" in state.split("+") and reason == "admin: new fans", (state, reason)
    cluster.run("scontrol", "update", "nodename=n1", "state=resume")


def test_submit_is_refused_on_a_slurm_node_with_a_clear_message(cluster: Cluster) -> None:
    done = cluster.gpusched("n1", "submit", "--gpus", "1", "--", "true", check=False)
    assert done.returncode == 1, done
    assert "slurm-node mode" in done.stderr and "sbatch" in done.stderr, done.stderr
    cluster.gpusched("n1", "gpus")  # the daemon keeps serving


def test_no_node_ever_showed_a_prolog_error(cluster: Cluster) -> None:
    assert_no_prolog_trouble(cluster)
    for log in Path(cluster.base, "log").glob("*.log"):
        text = log.read_text(errors="replace").lower()
        assert "prolog failed" not in text and "epilog failed" not in text and "taskprolog failed" not in text, log
