"""Time-less Alibaba pod lists (multigpu50) replayed with times borrowed by --times-from.

Fixtures (hand-written in the format of the alibaba/clusterdata cluster-trace-gpu-v2023 pod lists,
ATC '23 "Beware of Fragmentation"): tests/fixtures/alibaba_timeless_pods.csv (8 pods, no time columns) and
alibaba_timeless_times.csv (5 of those names with times: 3 replayable, one without a GPU, one never
scheduled). Pods 0005-0007 have no namesake and must be given the times of one of the 3 replayable pods.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpusched.replay.runner import run_replay
from gpusched.replay.timesource import TimeSourceError, load_time_source
from gpusched.replay.trace import Trace, TraceError, detect_format, load_trace
from gpusched_cli.main import cli

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
PODS = str(FIXTURES / "alibaba_timeless_pods.csv")
TIMES = str(FIXTURES / "alibaba_timeless_times.csv")
# (creation, duration = deletion - scheduled) of the replayable pods of TIMES, read off the file.
REPLAYABLE = {(0.0, 1000.0), (100.0, 590.0), (400.0, 2000.0)}


def _unscaled(trace: Trace) -> dict[str, tuple[float, float]]:
    """Pod name -> (creation time before the --load rescaling, duration)."""
    t0 = trace.jobs[0].submit_s
    return {j.name: (round(t0 + (j.submit_s - t0) / trace.time_scale, 6), j.duration_s) for j in trace.jobs}


def test_timeless_header_is_alibaba_and_asks_for_times_from() -> None:
    assert detect_format(PODS) == "alibaba"
    with pytest.raises(TraceError) as info:
        load_trace(PODS)
    [err] = info.value.errors
    assert (err.line, err.field) == (1, "creation_time|scheduled_time|deletion_time")
    assert "--times-from" in str(info.value)


def test_times_by_name_and_drawn_from_replayable_pods() -> None:
    trace = load_trace(PODS, times_from=TIMES, gpus=8)
    assert (trace.times_from, trace.times_matched, trace.times_drawn) == (TIMES, 5, 3)
    # Namesakes keep their own fate: 0002 has no GPU, 0003 was never scheduled in TIMES.
    assert dict(trace.skipped) == {"no GPU": 1, "never scheduled": 1}
    got = _unscaled(trace)
    assert got["openb-pod-0000"] == (0.0, 1000.0)
    assert got["openb-pod-0001"] == (100.0, 590.0)
    assert got["openb-pod-0004"] == (400.0, 2000.0)
    drawn = {n: got[n] for n in ("openb-pod-0005", "openb-pod-0006", "openb-pod-0007")}
    assert set(drawn.values()) <= REPLAYABLE  # never the GPU-less or never-scheduled pod's times
    requests = {j.name: j.request for j in trace.jobs}
    assert getattr(requests["openb-pod-0005"], "gpus", None) == 8  # requests stay the pod list's own


def test_draw_is_deterministic_and_follows_the_seed() -> None:
    def draws(seed: int) -> dict[str, tuple[float, float]]:
        got = _unscaled(load_trace(PODS, times_from=TIMES, gpus=8, seed=seed))
        return {n: v for n, v in got.items() if n >= "openb-pod-0005"}

    assert draws(1) == draws(1)
    assert len({tuple(sorted(draws(s).items())) for s in range(1, 6)}) > 1


def test_times_from_refused_for_traces_that_have_times(write_csv: Callable[[str], str]) -> None:
    with pytest.raises(ValueError, match="has its own time columns"):
        load_trace(TIMES, times_from=TIMES)
    with pytest.raises(ValueError, match="not for a generic CSV"):
        load_trace(write_csv("submit_time,duration,user,gpus\n0,1,a,1\n"), times_from=TIMES)


def test_bad_reference_names_file_line_and_field(write_csv: Callable[[str], str]) -> None:
    with pytest.raises(TimeSourceError, match="its header lacks creation_time, scheduled_time, deletion_time"):
        load_time_source(PODS)
    bad = write_csv("name,num_gpu,creation_time,deletion_time,scheduled_time\na,1,x,10,0\nb,1,0,,0\n")
    with pytest.raises(TimeSourceError) as info:
        load_time_source(bad)
    text = str(info.value)
    assert f"{bad}: line 2, field 'creation_time': 'x' is not a number" in text
    assert f"{bad}: line 3, field 'deletion_time': missing value" in text
    empty = write_csv("name,num_gpu,creation_time,deletion_time,scheduled_time\na,0,0,10,0\nb,1,5,9,\n")
    with pytest.raises(TimeSourceError, match="no replayable pod"):
        load_time_source(empty)


def test_run_replay_replays_every_policy() -> None:
    report = run_replay(PODS, times_from=TIMES, gpus="H100-80GB:8")
    for s in report.summaries:
        assert s["jobs"] == 6 and s["skipped"] == 2, s["policy"]


def test_cli_times_from() -> None:
    runner = CliRunner()
    result = runner.invoke(cli, ["replay", PODS])
    assert result.exit_code == 2
    assert "creation_time|scheduled_time|deletion_time" in result.output and "--times-from" in result.output
    result = runner.invoke(cli, ["replay", PODS, "--times-from", TIMES, "--policy", "fifo-whole"])
    assert result.exit_code == 0, result.output
    assert f"times from {TIMES}: 5 rows by pod name, 3 rows drawn" in result.output
    result = runner.invoke(cli, ["replay", PODS, "--times-from", TIMES, "--json", "--policy", "gpusched"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["jobs"] == 6
    result = runner.invoke(cli, ["replay", TIMES, "--times-from", TIMES])
    assert result.exit_code == 2 and "has its own time columns" in result.output


def test_censored_follows_the_time_source() -> None:
    """A borrowed row is censored when its times end at the last deletion_time of the times file
    (pod 0004 there: 2400), whether it was matched by name or drawn."""
    kept = load_trace(PODS, times_from=TIMES)
    dropped = load_trace(PODS, times_from=TIMES, censored="drop")
    ended_last = [n for n, (_, d) in _unscaled(kept).items() if d == 2000.0]  # deletion 2400 - scheduled 400
    assert "openb-pod-0004" in ended_last
    assert sorted(j.name for j in dropped.jobs) == sorted(set(_unscaled(kept)) - set(ended_last))
    assert dropped.skipped["still running when the trace was taken (--censored drop)"] == len(ended_last)


def test_cli_censored_drop_reports_the_skipped_pods() -> None:
    result = CliRunner().invoke(cli, ["replay", PODS, "--times-from", TIMES, "--censored", "drop",
                                      "--policy", "fifo-whole"])
    assert result.exit_code == 0, result.output
    assert "still running when the trace was taken (--censored drop)" in result.output
    bad = CliRunner().invoke(cli, ["replay", PODS, "--times-from", TIMES, "--censored", "trim"])
    assert bad.exit_code == 2 and "--censored" in bad.output
