"""The Slurm hooks against what docs/slurm.md promises, from an audit (each test failed on the hooks
before): a uid of `--5` failed the Prolog and `-7` passed as a uid; the MPS daemon was started on
the job's first GPU, not its MPS one; an unreadable record made the Epilog (and a Prolog that could
not write one) end in a traceback; a job with no GPU on the node saw them all."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpusched.gpu import simmps
from gpusched.slurm import gresconf, hooks
from tests.conftest import short_tmpdir


def device(index, uuid, gpu, gi, mps=False):
    files = (f"/dev/nvidia{gpu}",) if gi is None else (f"/dev/nvidia{gpu}", "/dev/nvidia-caps/nvidia-cap3")
    return gresconf.GresDevice(index=index, type="t", uuid=uuid, gpu_index=gpu, gpu_uuid=f"GPU-{gpu}", gi_id=gi,
                               files=files, mps=mps)


@pytest.fixture
def cfg():
    base = short_tmpdir()
    # GPU 0 whole, exclusive; GPU 1 whole, share = "mps"
    devs = [device(0, "GPU-excl", 0, None), device(1, "GPU-mps", 1, None, mps=True)]
    Path(base, "map.json").write_text(gresconf.gres_map("n1", devs))
    c = hooks.HookConfig(map_path=f"{base}/map.json", run_dir=f"{base}/run", job_mapping_dir=f"{base}/dcgm",
                         mps_control=simmps.__file__)
    yield c
    for pidf in Path(base, "run").glob("mps/*/pipe/*.pid"):
        with contextlib.suppress(Exception):
            os.kill(int(pidf.read_text()), 9)


def env(job, gpus, uid="1000"):
    return {"SLURM_JOB_ID": str(job), "SLURM_JOB_GPUS": gpus, "SLURM_JOB_UID": uid, "SLURMD_NODENAME": "n1"}


def hook_cli(kind: str, cfg: hooks.HookConfig, e: dict[str, str]) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-I", "-m", "gpusched_cli.main", "slurm", "hook", kind, "--map", cfg.map_path,
            "--run-dir", cfg.run_dir, "--mps-control", cfg.mps_control]
    penv = {"PATH": os.environ["PATH"], "PYTHONPATH": os.environ.get("PYTHONPATH", ""), **e}
    return subprocess.run(argv, capture_output=True, text=True, env=penv, timeout=60, check=False)


@pytest.mark.parametrize("uid", ["--5", "-", "--"])
def test_garbage_uid_is_recorded_for_the_job_not_a_failing_prolog(cfg, uid):
    """docs/slurm.md: 'a SLURM_JOB_UID that is not a number ... is written into the job's record';
    'The only non-zero exit is a Prolog run by hand without SLURM_JOB_ID'."""
    done = hook_cli("prolog", cfg, env(31, "0", uid=uid))
    assert done.returncode == 0, done.stderr
    assert "not a uid" in Path(cfg.run_dir, "jobs", "31.env").read_text()


def test_negative_uid_is_not_a_uid(cfg):
    rec = hooks.prolog(cfg, env(32, "0", uid="-7"))
    assert rec.error is not None and "SLURM_JOB_UID" in rec.error, rec


def test_mps_daemon_is_started_for_the_mps_gpu_not_the_first_gpu(cfg):
    """A job given GPU 0 (exclusive) and GPU 1 (share = "mps") must get its MPS daemon on GPU 1."""
    rec = hooks.prolog(cfg, env(33, "0,1"))
    assert rec.error is None, rec.error
    assert rec.mps_device == "GPU-mps", rec.mps_device


def test_epilog_with_an_unreadable_record_exits_0_without_a_traceback(cfg):
    """docs/slurm.md: 'The Epilog always exits 0 too.' (a non-zero Epilog drains the node in Slurm)"""
    assert hook_cli("prolog", cfg, env(34, "0")).returncode == 0
    rec = Path(cfg.run_dir, "jobs", "34.json")
    rec.write_text(json.dumps({**json.loads(rec.read_text()), "added_by_a_newer_version": 1}))
    done = hook_cli("epilog", cfg, env(34, ""))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    rec.write_text("{")  # truncated
    done = hook_cli("epilog", cfg, env(34, ""))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr


def test_prolog_that_cannot_write_its_record_says_so_without_a_traceback(cfg):
    Path(cfg.run_dir).mkdir(parents=True)
    Path(cfg.run_dir, "jobs").write_text("not a directory")
    done = hook_cli("prolog", cfg, env(35, "0"))
    assert "Traceback" not in done.stderr, done.stderr


def test_a_job_with_no_gpu_on_the_node_sees_none(cfg):
    """Slurm 22.05 sets nothing for a job without --gres; unset, CUDA_VISIBLE_DEVICES lets CUDA
    enumerate every GPU of the node, other jobs' slices too."""
    assert hook_cli("prolog", cfg, env(36, "")).returncode == 0
    out = hook_cli("task-prolog", cfg, env(36, "")).stdout
    assert "export CUDA_VISIBLE_DEVICES=\n" in out, out


def test_a_job_on_two_mps_gpus_is_told_it_can_use_one(cfg):
    devs = [device(0, "GPU-a", 0, None, mps=True), device(1, "GPU-b", 1, None, mps=True)]
    Path(cfg.map_path).write_text(gresconf.gres_map("n1", devs))
    rec = hooks.prolog(cfg, env(37, "0,1"))
    assert rec.error is not None and "2 GPUs shared through MPS" in rec.error, rec
