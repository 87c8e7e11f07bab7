"""Slurm's Prolog / TaskProlog / Epilog on real files and the simulated MPS control program."""

from __future__ import annotations

import io
import os
import subprocess
from pathlib import Path

import pytest

from gpusched.gpu import simmps
from gpusched.slurm import export, gresconf, hooks
from tests.conftest import short_tmpdir


def device(index: int, uuid: str, gpu: int, gi: int | None, mps: bool = False) -> gresconf.GresDevice:
    files = (f"/dev/nvidia{gpu}",) if gi is None else (f"/dev/nvidia{gpu}", "/dev/nvidia-caps/nvidia-cap3")
    return gresconf.GresDevice(index=index, type="t", uuid=uuid, gpu_index=gpu, gpu_uuid=f"GPU-{gpu}", gi_id=gi,
                               files=files, mps=mps)


@pytest.fixture
def cfg() -> hooks.HookConfig:
    base = short_tmpdir()  # short: MPS pipe directories hold Unix sockets
    devs = [device(0, "GPU-aaa", 0, None, mps=True), device(1, "MIG-bbb", 1, 2), device(2, "MIG-ccc", 1, 3)]
    Path(base, "map.json").write_text(gresconf.gres_map("n1", devs))
    return hooks.HookConfig(map_path=f"{base}/map.json", run_dir=f"{base}/run", job_mapping_dir=f"{base}/dcgm",
                            mps_control=simmps.__file__)


def env(job: int, gpus: str, uid: int = 1000) -> dict[str, str]:
    return {"SLURM_JOB_ID": str(job), "SLURM_JOB_GPUS": gpus, "SLURM_JOB_UID": str(uid), "SLURMD_NODENAME": "n1"}


def alive(pid: int) -> bool:
    """Running, not gone or a zombie (a double-forked daemon is reaped by init, whenever it gets to it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def task_output(cfg: hooks.HookConfig, job: int) -> str:
    out = io.StringIO()
    hooks.task_prolog(cfg, {"SLURM_JOB_ID": str(job)}, out)
    return out.getvalue()


def test_prolog_turns_slurm_indices_into_uuids_and_epilog_undoes_it(cfg: hooks.HookConfig) -> None:
    rec = hooks.prolog(cfg, env(7, "1,2"))
    assert rec.error is None and rec.uuids == ["MIG-bbb", "MIG-ccc"]
    assert task_output(cfg, 7) == "export CUDA_VISIBLE_DEVICES=MIG-bbb,MIG-ccc\n"
    assert Path(cfg.run_dir, "jobs", "7.env").read_text() == task_output(cfg, 7)
    dcgm = Path(str(cfg.job_mapping_dir))
    assert {p.name: p.read_text() for p in dcgm.iterdir()} == {"1.2": "7\n", "1.3": "7\n"}
    hooks.prolog(cfg, env(8, "1-2"))  # ranges, and a second job on the same devices
    assert (dcgm / "1.2").read_text() == "7\n8\n"
    assert hooks.epilog(cfg, env(7, "")) == []
    assert (dcgm / "1.2").read_text() == "8\n" and not Path(cfg.run_dir, "jobs", "7.json").exists()
    hooks.epilog(cfg, env(8, ""))
    assert list(dcgm.iterdir()) == [] and task_output(cfg, 8) == ""


def test_a_prolog_problem_goes_to_the_job_never_to_the_node(cfg: hooks.HookConfig) -> None:
    assert hooks.run("prolog", cfg, env(9, "5")) == 0  # index 5 is not in the map
    out = task_output(cfg, 9)
    assert out.startswith("print gpusched prolog on n1: GRES index 5 is not in") and "gpusched slurm export" in out
    assert out.endswith("export CUDA_VISIBLE_DEVICES=\n")  # no GPU rather than a wrong one
    assert hooks.run("epilog", cfg, env(9, "")) == 0
    assert hooks.run("prolog", cfg, {"SLURM_JOB_GPUS": "0"}) == 2  # not run by Slurm at all
    rec = hooks.JobRecord(job_id="10", uid=0, error="line one\nexport LD_PRELOAD=/tmp/x.so")
    assert hooks.task_prolog_lines(rec).splitlines() == [
        "print line one export LD_PRELOAD=/tmp/x.so; no GPU is visible to this job", "export CUDA_VISIBLE_DEVICES="]


def test_a_job_mapping_that_cannot_be_written_costs_the_label_not_the_gpu(cfg: hooks.HookConfig) -> None:
    Path(str(cfg.job_mapping_dir)).mkdir(mode=0o777)
    os.chmod(str(cfg.job_mapping_dir), 0o777)  # writable by anyone: refused (daemon/jobmap.py)
    rec = hooks.prolog(cfg, env(20, "1"))
    assert rec.error is None and rec.uuids == ["MIG-bbb"]
    lines = task_output(cfg, 20).splitlines()
    assert lines[0].startswith("print gpusched prolog on n1: dcgm job mapping:") and "writable by other" in lines[0]
    assert lines[1:] == ["export CUDA_VISIBLE_DEVICES=MIG-bbb"]
    hooks.epilog(cfg, env(20, ""))


def test_jobs_on_an_mps_gpu_share_one_control_daemon_per_user_until_the_last_ends(cfg: hooks.HookConfig) -> None:
    first = hooks.prolog(cfg, env(10, "0"))
    second = hooks.prolog(cfg, env(11, "0"))
    assert first.error is None and first.mps_pipe == second.mps_pipe and first.mps_pipe is not None
    pid = int(Path(first.mps_pipe, "nvidia-cuda-mps-control.pid").read_text())
    assert alive(pid)
    assert f"export CUDA_MPS_PIPE_DIRECTORY={first.mps_pipe}\n" in task_output(cfg, 10)
    other_user = hooks.prolog(cfg, env(12, "0", uid=1001))
    assert other_user.mps_pipe != first.mps_pipe  # per-user daemons
    try:
        hooks.epilog(cfg, env(10, ""))
        assert alive(pid)  # job 11 still uses it
        hooks.epilog(cfg, env(11, ""))
        assert not alive(pid)
    finally:
        for job in (10, 11, 12):
            hooks.epilog(cfg, env(job, ""))


def test_the_exported_task_prolog_script_only_prints_the_prepared_file(cfg: hooks.HookConfig) -> None:
    opts = export.ExportOptions(node="n1", out=os.path.dirname(cfg.map_path), run_dir=cfg.run_dir)
    script = Path(cfg.run_dir).parent / "task-prolog"
    script.write_text(export.hook_script("task-prolog", opts))
    script.chmod(0o755)
    hooks.prolog(cfg, env(13, "1"))

    def run(job_id: str) -> str:
        return subprocess.run([str(script)], env={"SLURM_JOB_ID": job_id}, capture_output=True, text=True,
                              check=True).stdout

    assert run("13") == "export CUDA_VISIBLE_DEVICES=MIG-bbb\n"
    assert run("14") == "" and run("../13") == "" and run("") == ""
    hooks.epilog(cfg, env(13, ""))


def test_slurm_job_gpus_is_parsed_strictly() -> None:
    assert hooks.parse_indices("0,2-4, 7") == [0, 2, 3, 4, 7]
    with pytest.raises(ValueError, match="SLURM_JOB_GPUS"):
        hooks.parse_indices("0,x")


@pytest.mark.parametrize(("name", "value", "said"), [
    ("SLURM_JOB_UID", "abc", "SLURM_JOB_UID 'abc' is not a uid"),
    ("SLURM_JOB_GPUS", "2-1", "'2-1' is not a range"),  # reversed: it parsed as no GPU, so every GPU
    ("SLURM_JOB_GPUS", "0-99999999", "'0-99999999' is not a range of at most 1024"),
])
def test_what_slurm_gives_the_prolog_that_does_not_parse_goes_to_the_job(
    cfg: hooks.HookConfig, name: str, value: str, said: str,
) -> None:
    """A bad uid made the Prolog exit 2 (which drains the node); a reversed range left the job with
    no CUDA_VISIBLE_DEVICES, that is with every GPU of the node (found by an operator audit)."""
    assert hooks.run("prolog", cfg, {**env(31, "1"), name: value}) == 0
    out = task_output(cfg, 31)
    assert said in out and out.endswith("export CUDA_VISIBLE_DEVICES=\n"), out
