"""The seed's story (bench/seed_story.py) meets issue 11's targets, with checkpoint and with requeue.

A trainer's six --requeue 24-hour jobs hold a 4-GPU node; two users send a 5-minute share-0.1
interactive job every 10 minutes for 36 hours. Interactive users must wait seconds, not a day, and
the trainer must finish about when FIFO would let it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gpusched.replay.runner import run_replay

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import seed_story


@pytest.mark.parametrize("checkpoint", [True, False])
def test_interactive_users_wait_seconds_and_the_trainer_finishes_on_time(tmp_path: Path, checkpoint: bool) -> None:
    trace = seed_story.write_trace(str(tmp_path / "story.csv"))
    config = tmp_path / "replay.toml"
    config.write_text(f"[replay]\ncheckpoint = {'true' if checkpoint else 'false'}\n")
    report = run_replay(trace, gpus=seed_story.GPUS, policies=["gpusched", "fifo-whole"], config_path=str(config))
    ours, fifo = report.summaries
    inter = ours["by_class"]["interactive"]["wait_p99_s"]
    assert inter <= 60.0
    assert fifo["by_class"]["interactive"]["wait_p99_s"] >= 20 * max(inter, 1.0)
    ends = {r.policy: max(j.ended_at or 0.0 for j in r.jobs if j.user == "trainer") for r in report.results}
    assert ends["gpusched"] <= 1.05 * ends["fifo-whole"]
    assert ours["jain_index"] >= 0.95
    preempted = [tr.reason for j in report.results[0].jobs for tr in j.history if tr.state.value == "PREEMPTED"]
    assert preempted, "the trainer holds every GPU when the first interactive job arrives"
    assert all(("checkpointed" in r) == checkpoint for r in preempted)
