"""Reloading the configuration: `gpusched admin reload` and SIGHUP, good and bad files, nothing lost."""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import pytest
from click.testing import CliRunner

from gpusched.model import JobState, ShareRequest
from gpusched.protocol import (
    ErrorCode,
    ProtocolError,
    ReloadRequest,
    ReloadResult,
    StatsRequest,
    StatsResult,
    SubmitRequest,
    SubmitResult,
)
from gpusched_cli.client import Client
from gpusched_cli.main import cli
from tests.conftest import DaemonProcess, wait_until
from tests.integration.test_daemon import spec, state_of, submit, wait_done


def gs(proc: DaemonProcess, *args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, ["--socket", proc.socket, *args], catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def test_reload_applies_weights_keeps_jobs_and_refuses_a_bad_file(
        daemon_process: Callable[..., DaemonProcess]) -> None:
    proc = daemon_process().start()
    with Client(proc.socket) as c:
        running = submit(c, spec("sleep", "30", gpus=2))
        wait_until(lambda: state_of(c, running) is JobState.RUNNING, what="running")
        pending = submit(c, spec("true"))
    proc.write_config('[fairness.weights]\nroot = 400\n')
    code, out, _ = gs(proc, "admin", "reload")
    assert code == 0 and out.strip() == "reloaded: fairness"
    with Client(proc.socket) as c:
        [root] = c.call(StatsRequest(), StatsResult).users
        assert root.weight == 400
        assert state_of(c, running) is JobState.RUNNING and state_of(c, pending) is JobState.PENDING

    proc.write_config('[fairness.weights]\nroot = 0\n')  # out of range
    code, _, err = gs(proc, "admin", "reload")
    assert code == 1
    assert f"configuration not reloaded: {proc.config_path}: invalid configuration: fairness.weights" in err
    assert "previous configuration" in err
    proc.write_config("tick_s = [\n")  # not TOML at all: SIGHUP must not kill the daemon either
    assert proc.proc is not None
    proc.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "configuration NOT reloaded" in proc.log(), what="reload refused in the log")
    assert "not valid TOML" in proc.log().split("configuration NOT reloaded")[1].splitlines()[0]
    with Client(proc.socket) as c:
        [root] = c.call(StatsRequest(), StatsResult).users
        assert root.weight == 400  # still the last good configuration

    # --socket on the command line still wins; a resource-bound key is reported, not applied.
    proc.write_config('socket = "/tmp/elsewhere.sock"\nmetrics_allow_remote = true\n[fairness.weights]\nroot = 400\n')
    with Client(proc.socket) as c:
        result = c.call(ReloadRequest(), ReloadResult)
        assert result.changed == [] and result.restart_needed == ["metrics_allow_remote"]
    assert gs(proc, "cancel", str(running))[0] == 0
    with Client(proc.socket) as c:
        assert wait_done(c, pending).job.state is JobState.COMPLETED
    assert proc.terminate() == 0


def test_reload_needs_an_admin_and_a_config_file(daemon_factory: Callable[..., object]) -> None:
    daemon = daemon_factory()
    with Client(daemon.socket) as c:  # type: ignore[attr-defined]
        reply = c.raw_call({"op": "reload"})
    assert reply["ok"] is False and reply["error"]["code"] == ErrorCode.BAD_REQUEST.value
    assert "started without a config file" in reply["error"]["message"]


def test_reload_that_makes_a_gpu_shared_is_seen_by_the_next_submit(
        daemon_process: Callable[..., DaemonProcess]) -> None:
    """The daemon keeps the devices' share modes between requests; a reload must replace them."""
    proc = daemon_process().start()
    share = spec("true", gpus=1).model_copy(update={"request": ShareRequest(fraction=0.5, gpu_mem_mib=1024)})
    with Client(proc.socket) as c:
        with pytest.raises(ProtocolError) as refused:
            c.call(SubmitRequest(spec=share), SubmitResult)
        assert refused.value.code is ErrorCode.UNSATISFIABLE
    proc.write_config('[gpus.0]\nshare = "mps"\n')
    code, out, _ = gs(proc, "admin", "reload")
    assert code == 0 and out.strip() == "reloaded: gpus"
    with Client(proc.socket) as c:
        job_id = c.call(SubmitRequest(spec=share), SubmitResult).job_id
        assert wait_done(c, job_id).job.state is JobState.COMPLETED
    assert proc.terminate() == 0


def test_a_reload_keeps_run_time_history_requeue_losses_and_preemption_counts(tmp_path: Any) -> None:
    """A reload that changes [scheduler] builds a new scheduler: what the old one learned and
    counted goes over to it (and the history is what gets saved at shutdown, not an empty one)."""
    import asyncio
    import json

    from gpusched.daemon import main as daemon_main
    from gpusched.daemon.store import Store
    from tests.conftest import inprocess_config, short_tmpdir

    base = short_tmpdir()
    config = inprocess_config(base)
    changed = inprocess_config(base, scheduler={"preempt_min_gain_s": 60.0})

    async def scenario() -> None:
        daemon = await daemon_main.start(config, loader=lambda: changed)
        try:
            before = daemon.engine.scheduler
            now = daemon.engine.clock()
            before.load_history({"user=alice": [10.0, 20.0]})
            before._budget.spend("alice", now, 14000.0)
            before._times_preempted[42] = 1
            result = await daemon.reload()
            after = daemon.engine.scheduler
            assert result.changed == ["scheduler"] and after is not before
            assert after.export_history() == {"user=alice": [10.0, 20.0]}
            assert after._budget.left("alice", now) == 14400.0 - 14000.0  # the default budget, less what was lost
            assert after._times_preempted == {42: 1}
        finally:
            await daemon_main.stop(daemon)

    asyncio.run(scenario())
    store = Store(config.db_path)
    try:
        assert json.loads(store.get_meta("runtime_history") or "{}") == {"user=alice": [10.0, 20.0]}
    finally:
        store.close()


def test_a_reload_reports_the_checkpoint_settings_as_needing_a_restart(tmp_path: Any) -> None:
    """Checkpointed jobs need the tool that checkpointed them: the reload must not claim to have
    switched it (it did not), but list the keys under restart_needed and keep them as they were."""
    import asyncio

    from gpusched.daemon import main as daemon_main
    from tests.conftest import inprocess_config, short_tmpdir

    base = short_tmpdir()
    config = inprocess_config(base)
    off = inprocess_config(base, checkpoint=False, checkpoint_timeout_s=5.0)

    async def scenario() -> tuple[list[str], list[str], bool, bool]:
        daemon = await daemon_main.start(config, loader=lambda: off)
        try:
            enabled = daemon.engine.checkpoints.enabled
            result = await daemon.reload()
            return result.changed, result.restart_needed, enabled, daemon.engine.config.checkpoint
        finally:
            await daemon_main.stop(daemon)

    changed, restart, enabled, still = asyncio.run(scenario())
    assert enabled and still  # the simulated tool is there; the config keeps the running value
    assert changed == [] and restart == ["checkpoint", "checkpoint_timeout_s"]


def test_a_reload_that_sets_job_mapping_dir_maps_the_jobs_running_now(tmp_path: Any) -> None:
    import asyncio

    from gpusched.daemon import main as daemon_main
    from tests.conftest import inprocess_config, kill_job_processes, short_tmpdir, wait_running

    base = short_tmpdir()
    common: dict[str, Any] = {"allow_root_jobs": True, "kill_grace_s": 2.0}
    config = inprocess_config(base, **common)
    mapping = tmp_path / "dcgm-job-map"
    with_mapping = inprocess_config(base, **common, job_mapping_dir=str(mapping))

    async def scenario() -> tuple[int, list[str], str]:
        daemon = await daemon_main.start(config, loader=lambda: with_mapping)
        try:
            made = await daemon.engine.submit(uid=0, gid=0, user="root", spec=spec("sleep", "30"))
            await wait_running(daemon.engine, made.job_id)
            result = await daemon.reload()
            text = (mapping / "0").read_text() if (mapping / "0").exists() else ""
            running = daemon.engine.get(made.job_id)
            if running is not None:
                await daemon.engine.cancel(running, "test over")
            return made.job_id, result.changed, text
        finally:
            await daemon_main.stop(daemon)

    try:
        job_id, changed, text = asyncio.run(scenario())
    finally:
        kill_job_processes(config.state_dir)
    assert changed == ["job_mapping_dir"] and text == f"{job_id}\n"


def test_a_reload_cannot_mix_a_new_file_with_a_restart_key_into_a_forbidden_configuration(tmp_path: Any) -> None:
    """`mode` waits for a restart, `gpus` does not: a file that says mode = "standalone" and dynamic
    MIG must not give a slurm-node daemon dynamic MIG (which slurm-node forbids) until it restarts."""
    import asyncio

    from gpusched.config import ConfigError, GpuConfig
    from gpusched.daemon import main as daemon_main
    from tests.conftest import inprocess_config, short_tmpdir

    base = short_tmpdir()
    slurm_node = inprocess_config(base, mode="slurm-node", gpus={"0": GpuConfig(mig=["3g.40gb", "3g.40gb"])})
    standalone = inprocess_config(base, gpus={"0": GpuConfig(mig="dynamic")})

    async def scenario() -> tuple[str, object]:
        daemon = await daemon_main.start(slurm_node, loader=lambda: standalone)
        try:
            with pytest.raises(ConfigError) as refused:
                await daemon.reload()
            return str(refused.value), daemon.engine.config.gpus["0"].mig
        finally:
            await daemon_main.stop(daemon)

    message, mig = asyncio.run(scenario())
    assert "mode" in message and 'cannot be used with mode = "slurm-node"' in message
    assert mig == ["3g.40gb", "3g.40gb"]  # nothing applied
