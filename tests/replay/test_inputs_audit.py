"""Bad input to `gpusched replay`, found by an input-validation audit (each test failed on the code
before its fix): every bad trace, config or flag gives exit 2 (exit 1 for a plot that cannot be
written), a message naming the file and line/field (or section/key), no traceback, and an end."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

GPUSCHED = [os.path.join(os.path.dirname(sys.executable), "gpusched")]
H = "submit_time,duration,user,gpus,mig,share,gpu_mem,class,weight,time_limit,requeue,precision,name\n"
AH = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"
GOOD = H + "0,100,alice,1,,,,,,,,,\n10,200,bob,,,0.5,40000,,,,,,\n"
MIXED_HANG = (H + "240,1096,carol,4,,,,batch,,,1,,\n480,9053,alice,2,,,,batch,,,0,,\n"
              "960,2048,bob,,3g.40gb,,,batch,,,0,,\n1020,18650,carol,,,0.25,20000,interactive,,,1,,\n")


def replay(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    cwd = os.environ.get("AUDIT_CWD", "/tmp")  # --plot '' wrote ./.png: keep it out of the repository
    try:
        return subprocess.run([*GPUSCHED, "replay", *args], capture_output=True, text=True, timeout=timeout,
                              cwd=cwd)
    except subprocess.TimeoutExpired:
        pytest.fail(f"gpusched replay {' '.join(args)} did not finish in {timeout} s")


def bad(p: subprocess.CompletedProcess[str], *must: str, rc: int = 2) -> None:
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    assert p.returncode == rc, (p.returncode, p.stderr[-2000:])
    for m in must:
        assert m in p.stderr, (m, p.stderr[-2000:])


def write(tmp: Path, name: str, text: str | bytes) -> str:
    path = tmp / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return str(path)


# ---- flags -----------------------------------------------------------------------------------

def test_csv_load_zero_is_refused(tmp_path: Path) -> None:  # ZeroDivisionError traceback today
    bad(replay(write(tmp_path, "t.csv", GOOD), "--load", "0", "--policy", "fifo-whole"), "--load")


def test_csv_load_negative_is_refused(tmp_path: Path) -> None:  # accepted today: arrivals scaled by -1.3
    bad(replay(write(tmp_path, "t.csv", GOOD), "--load", "-1", "--policy", "fifo-whole"), "--load")


def test_csv_load_nan_terminates_and_is_refused(tmp_path: Path) -> None:  # spins for ever today (sim.py:70)
    bad(replay(write(tmp_path, "t.csv", GOOD), "--load", "nan", "--policy", "fifo-whole", timeout=30), "--load")


def test_plot_into_missing_directory_no_traceback(tmp_path: Path) -> None:  # FileNotFoundError traceback
    bad(replay(write(tmp_path, "t.csv", GOOD), "--policy", "fifo-whole", "--plot", str(tmp_path / "no" / "x.png")),
        "x.png", rc=1)


def test_plot_write_error_is_reported(tmp_path: Path) -> None:  # "plot written to /dev/full", exit 0 today
    bad(replay(write(tmp_path, "t.csv", GOOD), "--policy", "fifo-whole", "--plot", "/dev/full"), rc=1)


def test_plot_empty_path_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # wrote ./.png
    monkeypatch.setenv("AUDIT_CWD", str(tmp_path))
    p = replay(write(tmp_path, "t.csv", GOOD), "--policy", "fifo-whole", "--plot", "")
    assert p.returncode == 2 and "Traceback" not in p.stderr, (p.returncode, p.stdout[-300:])
    assert not (tmp_path / ".png").exists()


# ---- trace files -----------------------------------------------------------------------------

def test_field_over_csv_limit_no_traceback(tmp_path: Path) -> None:  # _csv.Error traceback, exit 1
    path = write(tmp_path, "t.csv", "submit_time,duration,user,gpus\n0,10," + "a" * 131073 + ",1\n")
    bad(replay(path, "--policy", "fifo-whole"), path, "line 2")


def test_char_device_trace_is_bounded() -> None:  # /dev/zero: reads one endless line until MemoryError/OOM
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1_500_000_000, 1_500_000_000))

    p = subprocess.run([*GPUSCHED, "replay", "/dev/zero"], capture_output=True, text=True, timeout=60,
                       preexec_fn=limit)
    bad(p, "/dev/zero")


def test_non_utf8_names_the_file(tmp_path: Path) -> None:  # "'utf-8' codec can't decode byte 0xff ..." only
    path = write(tmp_path, "t.csv", b"submit_time,duration,user,gpus\n0,10,al\xffice,1\n")
    bad(replay(path, "--policy", "fifo-whole"), path)


def test_alibaba_num_gpu_over_64_names_line_and_field(tmp_path: Path) -> None:  # raw pydantic dump today
    path = write(tmp_path, "a.csv", AH + "p,1,1,65,1000,,,,0,100,0\np2,1,1,1,1000,,,,5,100,6\n")
    bad(replay(path, "--policy", "fifo-whole"), f"{path}: line 2, field 'num_gpu'")


def test_unknown_mig_profile_is_a_bad_row(tmp_path: Path) -> None:  # accepted; fifo-* run it, gpusched can't
    path = write(tmp_path, "t.csv", H + "0,10,alice,,9g.99gb,,,,,,,,\n")
    bad(replay(path), "line 2, field 'mig'")


def test_duplicate_column_is_refused(tmp_path: Path) -> None:  # last 'user' silently wins
    path = write(tmp_path, "t.csv", "submit_time,duration,user,user,gpus\n0,10,alice,bob,1\n")
    bad(replay(path, "--policy", "fifo-whole"), "user")


def test_row_with_more_fields_than_header_is_refused(tmp_path: Path) -> None:  # extra cells silently dropped
    path = write(tmp_path, "t.csv", "submit_time,duration,user,gpus\n0,10,alice,1,7,8\n")
    bad(replay(path, "--policy", "fifo-whole"), "line 2")


def test_gpu_mem_with_gpus_is_refused(tmp_path: Path) -> None:  # refused with mig, silently ignored with gpus
    path = write(tmp_path, "t.csv", H + "0,10,alice,1,,,1000,,,,,,\n")
    bad(replay(path, "--policy", "fifo-whole"), "line 2, field 'gpu_mem'")


# ---- replay config ---------------------------------------------------------------------------

CONFIG_TYPE_ERRORS = {  # each crashes with a traceback today
    "history_float": ("[estimator]\nhistory = 2.5\n", "history"),
    "weights_str": ("[fairness]\nweights = \"x\"\n", "weights"),
    "groups_str": ("[fairness]\ngroups = \"x\"\n", "groups"),
    "min_idle_str": ("[mig]\nmin_idle_s = \"x\"\n", "min_idle_s"),
    "max_scan_str": ("[scheduler]\nmax_scan = \"x\"\n", "max_scan"),
    "preempt_after_str": ("[scheduler]\npreempt_after_s = \"x\"\n", "preempt_after_s"),
    "replicas_str": ("[replay]\ntimeslice_replicas = \"x\"\n", "timeslice_replicas"),
}

CONFIG_SILENTLY_ACCEPTED = {  # exit 0 today; the daemon's own [scheduler]/[mig] ranges refuse them
    "checkpoint_str": ("[replay]\ncheckpoint = \"no\"\n", "checkpoint"),  # "no" is truthy: checkpoint ON
    "mps_across_bad": ("[scheduler]\nmps_across_users = \"sometimes\"\n", "mps_across_users"),
    "max_scan_0": ("[scheduler]\nmax_scan = 0\n", "max_scan"),
    "min_idle_neg": ("[mig]\nmin_idle_s = -1\n", "min_idle_s"),
    "preempt_neg": ("[scheduler]\npreempt_after_s = -1\n", "preempt_after_s"),
    "headroom_frac_2": ("[scheduler]\ninteractive_headroom_fraction = 2\n", "interactive_headroom_fraction"),
    "default_weight_float": ("[fairness]\ndefault_weight = 1.5\n", "default_weight"),
    "quantum_nan": ("[fairness]\nbatch_quantum_s = nan\n", "batch_quantum_s"),
    "waste_str": ("[replay]\nmig_max_waste = \"x\"\n", "mig_max_waste"),
}

CONFIG_HANGS = {  # never finish today
    "mig_create_nan": ("[interference]\nmig_create_s = nan\n", "mig_create_s"),
    "restore_nan": ("[interference]\ncheckpoint_restore_s = nan\n", "checkpoint_restore_s"),
}


@pytest.mark.parametrize("case", sorted({**CONFIG_TYPE_ERRORS, **CONFIG_SILENTLY_ACCEPTED, **CONFIG_HANGS}))
def test_bad_replay_config_names_key(tmp_path: Path, case: str) -> None:
    text, key = {**CONFIG_TYPE_ERRORS, **CONFIG_SILENTLY_ACCEPTED, **CONFIG_HANGS}[case]
    cfg = write(tmp_path, "r.toml", text)
    trace = write(tmp_path, "t.csv", MIXED_HANG)
    bad(replay(trace, "--gpus", "H100-80GB:4", "--config", cfg, timeout=30), cfg, key)


def test_estimator_nan_names_key(tmp_path: Path) -> None:  # "(nan, 'carol') not in the user order" today
    cfg = write(tmp_path, "r.toml", "[estimator]\ndefault_runtime_s = nan\n")
    bad(replay(write(tmp_path, "t.csv", MIXED_HANG), "--gpus", "H100-80GB:4", "--config", cfg, timeout=30),
        cfg, "default_runtime_s")


def test_non_utf8_replay_config_names_file(tmp_path: Path) -> None:
    cfg = write(tmp_path, "r.toml", b"[fairness]\n# \xff\n")
    bad(replay(write(tmp_path, "t.csv", GOOD), "--config", cfg), cfg)


def test_backfill_false_replay_terminates(tmp_path: Path) -> None:
    """A valid config: [scheduler] backfill = false. carol's 4-GPU head waits for the GPU kept as
    interactive headroom for her own pending interactive share, which is never looked at because the
    pass stops at the head (core/scheduler.py:265): nothing ever starts, the replay never ends."""
    cfg = write(tmp_path, "r.toml", "[scheduler]\nbackfill = false\n")
    p = replay(write(tmp_path, "t.csv", MIXED_HANG), "--gpus", "H100-80GB:4", "--policy", "gpusched", "--config", cfg,
               timeout=30)
    assert p.returncode == 0, p.stderr[-2000:]
