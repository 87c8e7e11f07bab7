"""`gpusched replay` end to end through click, as users run it (no daemon needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpusched.replay.metrics import JSON_KEYS
from gpusched.replay.policies import ReplayConfigError, load_config
from gpusched_cli.main import cli

TRACE = """
submit_time,duration,user,gpus,mig,share,gpu_mem,weight
0,100,alice,1,,,,200
0,50,bob,,,0.5,20000,
10,30,alice,,3g.40gb,,,
30,60,carol,2,,,,
"""


def test_replay_json_all_policies(write_csv: Callable[[str], str]) -> None:
    result = CliRunner().invoke(cli, ["replay", write_csv(TRACE), "--gpus", "H100-80GB:3", "--json"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.output.splitlines()]
    assert [r["policy"] for r in rows] == ["gpusched", "fifo-whole", "fifo-timeslice", "static-mig"]
    for r in rows:
        assert tuple(r) == JSON_KEYS
        assert r["jobs"] == 4 and r["skipped"] == 0
        assert 0 < r["utilization"] <= 1
    assert rows[0]["mig_reconfigurations"] >= 1  # the 3g.40gb was created on demand


def test_replay_table_and_plot(write_csv: Callable[[str], str], tmp_path: Path) -> None:
    png = tmp_path / "out.png"
    result = CliRunner().invoke(cli, ["replay", write_csv(TRACE), "--gpus", "H100-80GB:2", "--policy",
                                      "fifo-whole", "--plot", str(png)])
    assert result.exit_code == 0, result.output
    assert "fifo-whole" in result.output and "makespan_s" in result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replay_bad_trace_exits_2(write_csv: Callable[[str], str]) -> None:
    path = write_csv("submit_time,duration,user,gpus\n0,10,a,1\n0,ten,a,1\n")
    result = CliRunner().invoke(cli, ["replay", path])
    assert result.exit_code == 2
    assert "line 3, field 'duration'" in result.output


@pytest.mark.parametrize("args", [["--policy", "lottery"], ["--gpus", "B200:8"], ["--gpus", "H100-80GB:x"]])
def test_replay_bad_options_exit_2(write_csv: Callable[[str], str], args: list[str]) -> None:
    result = CliRunner().invoke(cli, ["replay", write_csv(TRACE), *args])
    assert result.exit_code == 2, result.output


def test_replay_config_file(write_csv: Callable[[str], str], tmp_path: Path) -> None:
    cfg = tmp_path / "replay.toml"
    cfg.write_text('[fairness]\nweights = { bob = 300 }\n[replay]\nmig_gpus = 0\ntimeslice_replicas = 2\n'
                   '[interference]\ntimeslice_overhead = 0.2\n[mig]\nmin_idle_s = 10\n')
    loaded = load_config(str(cfg))
    assert loaded.mig_gpus == 0 and loaded.timeslice_replicas == 2
    assert loaded.scheduler.fairness.weights == {"bob": 300} and loaded.scheduler.mig.min_idle_s == 10
    assert loaded.interference.timeslice_overhead == 0.2
    result = CliRunner().invoke(cli, ["replay", write_csv(TRACE), "--gpus", "H100-80GB:2", "--json",
                                      "--config", str(cfg), "--policy", "gpusched"])
    assert result.exit_code == 0, result.output
    row = json.loads(result.output)
    assert row["mig_reconfigurations"] == 0 and row["skipped"] == 1  # no MIG GPU: the 3g.40gb job can't run


@pytest.mark.parametrize(("text", "needle"), [
    ("[bogus]\n", "unknown section [bogus]"),
    ("[replay]\ncolour = 1\n", "[replay] unknown key(s): colour"),
    ("[fairness]\ndefault_weight = 0\n", "[fairness]"),
    ("[replay]\nmig_gpus = -1\n", "mig_gpus"),
    ("[interference]\ntimeslice_overhead = 2\n", "[interference]"),
    ("not toml", "not valid TOML"),
])
def test_replay_config_errors(tmp_path: Path, text: str, needle: str) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    with pytest.raises(ReplayConfigError) as info:
        load_config(str(cfg))
    assert needle in str(info.value) and str(cfg) in str(info.value)


def test_client_does_not_import_replay_at_start() -> None:
    code = "import sys, gpusched_cli.main; print([m for m in sys.modules if m.startswith('gpusched.replay')])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_load_that_cannot_be_applied_is_said_so(write_csv: Callable[[str], str]) -> None:
    """`--load` was silently ignored for a trace whose jobs all arrive at once (audit)."""
    same = "submit_time,duration,user,gpus\n0,100,alice,1\n0,100,bob,1\n"
    result = CliRunner().invoke(cli, ["replay", write_csv(same), "--gpus", "H100-80GB:1", "--load", "0.5",
                                      "--policy", "fifo-whole"])
    assert result.exit_code == 0, result.output
    assert "--load not applied: every job arrives at the same time" in result.output
