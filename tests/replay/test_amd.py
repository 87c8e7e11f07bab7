"""Replays on AMD Instinct nodes (`--gpus MI300X:N`): logical GPUs through the real AmdSmiBackend over
the simulated amdsmi; static-mig is skipped with its reason; MIG rows and MPS shares are refused."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpusched.model import JobState
from gpusched.replay.policies import ReplayConfig, setup
from gpusched.replay.runner import render_table, run_replay
from gpusched.replay.sim import Simulator
from gpusched.replay.trace import load_trace
from gpusched.replay.vendor import PolicySkipped
from gpusched_cli.main import cli
from tests.replay.conftest import ALIBABA

TRACE = """
submit_time,duration,user,gpus,mig,share,gpu_mem,weight
0,100,alice,1,,,,200
0,50,bob,,,0.5,20000,
30,60,carol,2,,,,
40,20,dave,1,,,,
"""


def test_alibaba_sample_on_mi300x_runs_every_policy_but_static_mig() -> None:
    report = run_replay(str(ALIBABA), gpus="MI300X:2")
    assert [s["policy"] for s in report.summaries] == ["gpusched", "fifo-whole", "fifo-timeslice"]
    assert [(s.policy, "no MIG" in s.reason) for s in report.skipped] == [("static-mig", True)]
    for summary in report.summaries:
        assert summary["jobs"] == 26 and 0 < float(summary["utilization"]) <= 1  # type: ignore[arg-type]
        assert summary["mig_reconfigurations"] == 0
    assert "static-mig: skipped: MI300X has no MIG" in render_table(report)
    gpusched = report.results[0]
    assert "timeslice shares" in gpusched.node and "no MPS" in gpusched.node


def test_the_replay_runs_on_amd_logical_gpus(write_csv: Callable[[str], str]) -> None:
    models = ("MI325X", "MI325X")
    trace = load_trace(write_csv(TRACE), "auto", gpus=2, gpu_memory_mib=256 * 1024)
    sim = Simulator(setup("gpusched", models, trace.jobs, ReplayConfig()), trace.jobs,
                    ReplayConfig().interference)
    assert [(g.vendor, g.model, g.partition is not None) for g in sim.gpus] == [("amd", "MI325X", True)] * 2
    assert sim.share_modes == {g.uuid: "timeslice" for g in sim.gpus}
    result = sim.run()
    assert {j.state for j in result.jobs} == {JobState.COMPLETED}
    used = {d.uuid for j in result.jobs if j.allocation for d in j.allocation.devices}
    assert used <= {g.uuid for g in sim.gpus} and len(used) == 2


def test_static_mig_alone_on_amd_is_a_usage_error(write_csv: Callable[[str], str]) -> None:
    result = CliRunner().invoke(cli, ["replay", write_csv(TRACE), "--gpus", "MI300X:2", "--policy", "static-mig"])
    assert result.exit_code == 2
    assert "no policy runs on this node: static-mig: MI300X has no MIG" in result.output


def test_json_keeps_one_summary_per_line_and_says_what_was_skipped(write_csv: Callable[[str], str]) -> None:
    result = CliRunner().invoke(cli, ["replay", write_csv(TRACE), "--gpus", "MI300X:2", "--json"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert [json.loads(line)["policy"] for line in lines] == ["gpusched", "fifo-whole", "fifo-timeslice"]
    assert "static-mig skipped" in result.stderr


@pytest.mark.parametrize("args, needle", [
    (["--gpus", "H100-80GB:1,MI300X:1"], "mixes NVIDIA (H100-80GB) and AMD (MI300X)"),
    (["--gpus", "MI400X:2"], "AMD Instinct: MI300X, MI325X"),
    (["--gpus", "MI300X:2@CPX"], "partition modes are not replayed"),
])
def test_bad_amd_gpus_exit_2(write_csv: Callable[[str], str], args: list[str], needle: str) -> None:
    result = CliRunner().invoke(cli, ["replay", write_csv(TRACE), *args])
    assert result.exit_code == 2
    assert needle in result.output


def test_mig_rows_are_bad_rows_on_amd(write_csv: Callable[[str], str]) -> None:
    path = write_csv(TRACE + "50,10,erin,,3g.40gb,,,\n")
    result = CliRunner().invoke(cli, ["replay", path, "--gpus", "MI300X:2"])
    assert result.exit_code == 2
    assert "3g.40gb is not a MIG profile of MI300X (they offer none: AMD GPUs have no MIG)" in result.output


def test_mps_shares_on_amd_are_a_config_error(write_csv: Callable[[str], str], tmp_path: Path) -> None:
    config = tmp_path / "replay.toml"
    config.write_text('[replay]\nshare_mode = "mps"\n')
    result = CliRunner().invoke(cli, ["replay", write_csv(TRACE), "--gpus", "MI300X:2", "--config", str(config)])
    assert result.exit_code == 2
    assert 'share_mode = "mps": MPS is NVIDIA only' in result.output
    nvidia = CliRunner().invoke(cli, ["replay", write_csv(TRACE), "--gpus", "H100-80GB:2", "--config", str(config),
                                      "--policy", "gpusched"])
    assert nvidia.exit_code == 0, nvidia.output
    assert "mps shares" in nvidia.output


def test_setup_raises_skipped_for_static_mig_on_amd() -> None:
    with pytest.raises(PolicySkipped) as err:
        setup("static-mig", ("MI300X",), [], ReplayConfig())
    assert err.value.policy == "static-mig"
