"""The interference model's defaults reach the simulator, and the config can override them."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gpusched.replay.policies import Interference, ReplayConfig, ReplayConfigError, config_from_dict
from gpusched.replay.runner import run_replay

TWO_SHARES = "submit_time,duration,user,share,gpu_mem\n0,100,a,0.5,20000\n0,100,a,0.5,20000\n"


def test_defaults_are_the_measured_ones() -> None:
    # docs/replay.md "Interference model" derives these from published measurements.
    assert Interference() == Interference(timeslice_overhead=0.20, mps_slowdown=0.15, mig_create_s=2.0,
                                          mig_destroy_s=1.0)


@pytest.mark.parametrize("slowdown", [0.0, 0.15, 0.3])
def test_mps_clients_run_at_one_minus_slowdown(write_csv: Callable[[str], str], slowdown: float) -> None:
    # One GPU in MPS mode (one uid per MPS server, so one user), two half-GPU shares start together.
    cfg = ReplayConfig(interference=Interference(mps_slowdown=slowdown))
    report = run_replay(write_csv(TWO_SHARES), gpus="H100-80GB:1", policies=["gpusched"], config=cfg)
    jobs = report.results[0].jobs
    assert [j.started_at for j in jobs] == [0.0, 0.0]
    assert sorted(j.ended_at or 0 for j in jobs) == pytest.approx([100 / (1 - slowdown)] * 2)
    s = report.summaries[0]
    # Useful work is what the trace asked for; the slowdown only stretches the time it takes.
    assert s["useful_utilization"] == pytest.approx(1.0 * 100 / (100 / (1 - slowdown)), abs=1e-6)


def test_config_overrides_and_validates() -> None:
    cfg = config_from_dict({"interference": {"mps_slowdown": 0.3, "timeslice_overhead": 0.1}})
    assert cfg.interference == Interference(timeslice_overhead=0.1, mps_slowdown=0.3)
    with pytest.raises(ReplayConfigError, match=r"\[interference\]"):
        config_from_dict({"interference": {"mps_slowdown": 1.0}})
