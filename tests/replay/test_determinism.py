"""Replay is deterministic: the same trace gives the same figures whatever PYTHONHASHSEED is.

Set iteration order follows string hashes, which change with PYTHONHASHSEED; a scheduler that
iterated a set of users while preempting gave different results run to run (issue 11). The seed's
story exercises preemption (checkpoint and requeue), headroom and shares from several users.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import seed_story  # noqa: E402


def _replay_json(trace: str, hashseed: str, config: str | None) -> list[dict[str, object]]:
    env = {**os.environ, "PYTHONHASHSEED": hashseed}
    args = [sys.executable, "-m", "gpusched_cli.main", "replay", trace, "--gpus", seed_story.GPUS, "--json"]
    if config is not None:
        args += ["--config", config]
    out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300, check=True, cwd=ROOT)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    for row in rows:
        row.pop("decision_us_mean")  # wall-clock time of the decisions: the one figure allowed to differ
    return rows


@pytest.mark.parametrize("checkpoint", [True, False])
def test_replay_figures_do_not_depend_on_the_hash_seed(tmp_path: Path, checkpoint: bool) -> None:
    trace = seed_story.write_trace(str(tmp_path / "story.csv"))
    config = None
    if not checkpoint:  # preemption by requeue, within the loss budget
        config = str(tmp_path / "replay.toml")
        Path(config).write_text("[replay]\ncheckpoint = false\n")
    first = _replay_json(trace, "1", config)
    assert [r["policy"] for r in first] == ["gpusched", "fifo-whole", "fifo-timeslice", "static-mig"]
    assert _replay_json(trace, "2", config) == first
    assert _replay_json(trace, "12345", config) == first
