"""`gpusched gpus drain|resume`, `mig apply` and `sim inject-xid` through the real CLI and daemon."""

from __future__ import annotations

import json
from collections.abc import Callable

from gpusched.config import GpuConfig
from gpusched.model import JobState
from tests.cli.test_commands import gs, submit, wait_state
from tests.conftest import DaemonHandle


def test_drain_resume_and_gpus_health(daemon: DaemonHandle) -> None:
    result = gs(daemon, "gpus", "drain", "0", "--reason", "maintenance")
    assert result.exit_code == 0, result.output
    assert "1 device(s) drained" in result.stdout
    listing = json.loads(gs(daemon, "gpus", "--json").stdout)
    assert listing["gpus"][0]["health"] == "drained: drained by root: maintenance"
    assert "drained by root: maintenance" in gs(daemon, "gpus").stdout
    assert gs(daemon, "gpus", "resume", "0").exit_code == 0
    assert json.loads(gs(daemon, "gpus", "--json").stdout)["gpus"][0]["health"] == "ok"
    missing = gs(daemon, "gpus", "drain", "9")
    assert missing.exit_code == 4 and "no GPU or MIG instance '9'" in missing.stderr


def test_mig_apply_dry_run_then_apply(daemon_factory: Callable[..., DaemonHandle]) -> None:
    node = daemon_factory(gpus={"0": GpuConfig(mig=[])})
    dry = gs(node, "mig", "apply", "0", "3g.40gb,2g.20gb", "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert "keep 0, destroy 0, create 2 (dry run)" in dry.stdout and "would create 3g.40gb" in dry.stdout
    assert json.loads(gs(node, "gpus", "--json").stdout)["gpus"][0]["instances"] == []
    done = gs(node, "mig", "apply", "0", "3g.40gb,2g.20gb")
    assert done.exit_code == 0 and "(applied)" in done.stdout
    profiles = sorted(i["profile"] for i in json.loads(gs(node, "gpus", "--json").stdout)["gpus"][0]["instances"])
    assert profiles == ["2g.20gb", "3g.40gb"]
    bad = gs(node, "mig", "apply", "1", "3g.40gb")
    assert bad.exit_code == 1 and "not in MIG mode" in bad.stderr
    unknown = gs(node, "mig", "apply", "7", "3g.40gb")  # not found, as in `gpus drain`
    assert unknown.exit_code == 4 and "no GPU 7" in unknown.stderr
    for slip in ("", " , ", "3g.40gb,,2g.20gb"):  # never read as `none`: that destroys every idle instance
        refused = gs(node, "mig", "apply", "0", slip)
        assert refused.exit_code == 2 and "LAYOUT" in refused.stderr and "no empty entries" in refused.stderr
    kept = sorted(i["profile"] for i in json.loads(gs(node, "gpus", "--json").stdout)["gpus"][0]["instances"])
    assert kept == ["2g.20gb", "3g.40gb"]
    cleared = gs(node, "mig", "apply", "0", "none")
    assert cleared.exit_code == 0 and "destroy 2" in cleared.stdout


def test_sim_inject_xid_fails_the_job_on_that_gpu(daemon: DaemonHandle) -> None:
    job_id = submit(daemon, "--gpus", "2", "--", "sleep", "30")
    wait_state(daemon, job_id, {JobState.RUNNING})
    result = gs(daemon, "sim", "inject-xid", "1", "79")
    assert result.exit_code == 0 and result.stdout.strip() == "XID 79 injected on GPU 1"
    assert wait_state(daemon, job_id, {JobState.FAILED}) is JobState.FAILED
    shown = gs(daemon, "show", str(job_id))
    assert "gpu_fault: XID 79" in shown.stdout
