"""`gpusched stats` against the real daemon."""

from __future__ import annotations

import json

from gpusched.model import JobState
from tests.cli.test_commands import gs, submit, wait_state
from tests.conftest import DaemonHandle


def test_stats_reports_service_waits_and_device_use(daemon: DaemonHandle) -> None:
    first = submit(daemon, "--gpus", "2", "--", "sleep", "0.6")
    second = submit(daemon, "--gpus", "1", "--", "true")  # waits for the first
    wait_state(daemon, second, {JobState.COMPLETED})
    wait_state(daemon, first, {JobState.COMPLETED})
    data = json.loads(gs(daemon, "stats", "--since", "10m", "--json").stdout)
    [root] = data["users"]
    assert root["user"] == "root" and root["jobs"] == 2 and root["starts"] == 2
    assert root["share"] == 1.0 and root["entitled"] == 1.0
    assert 2 * 0.6 / 3600 <= root["service_gpu_h"] < 2 * 3.0 / 3600
    assert root["wait_max_s"] >= 0.5  # the second job waited for the first to free a GPU
    assert data["jain_index"] == 1.0
    assert [d["kind"] for d in data["devices"]] == ["gpu", "gpu"]
    assert all(0 < d["busy_fraction"] <= 1 for d in data["devices"])
    text = gs(daemon, "stats").stdout
    assert "root" in text and "Jain's fairness index" in text
    bad = gs(daemon, "stats", "--since", "soon")
    assert bad.exit_code == 2 and "--since" in bad.stderr
