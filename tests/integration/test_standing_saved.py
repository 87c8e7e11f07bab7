"""The fair-share standing a restart reads back, from an audit of what the daemon keeps: the charge
of a job that had just ended was lost to a kill -9 (saved only with a pass's actions, or every 30th
pass), and a job that ended while no daemon ran was never charged for the downtime. Each test
fails on the code before."""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Callable

from gpusched_cli.client import Client
from tests.conftest import DaemonProcess, wait_until
from tests.integration.test_daemon import spec, submit


class _DefaultTick(DaemonProcess):
    """tick_s at its default (1 s): the every-30th-pass save is half a minute away."""

    def write_config(self, extra: str) -> None:
        with open(self.config_path, "w") as f:
            f.write('allow_root_jobs = true\nkill_grace_s = 2.0\ncgroup_root = "off"\n' + extra)


def _read(state_dir: str, sql: str, *args: object) -> object:
    db = sqlite3.connect(os.path.join(state_dir, "gpusched.db"))
    try:
        row = db.execute(sql, args).fetchone()
    finally:
        db.close()
    return row[0] if row else None


def _service(state_dir: str, user: str = "root") -> float:
    saved = _read(state_dir, "SELECT value FROM meta WHERE key = 'standing'")
    return float(json.loads(str(saved)).get(user, {}).get("service", 0.0)) if saved else 0.0


def _state(state_dir: str, job_id: int) -> object:
    return _read(state_dir, "SELECT state FROM jobs WHERE id = ?", job_id)


def test_a_job_that_just_ended_has_its_charge_saved_before_a_kill_9(
        daemon_process: Callable[..., DaemonProcess]) -> None:
    proc = daemon_process(sim="H100-80GB:1", cls=_DefaultTick).start()
    with Client(proc.socket) as c:
        submit(c, spec("sleep", "2"))
    wait_until(lambda: _state(proc.state_dir, 1) == "COMPLETED", timeout=20, what="the job done")
    wait_until(lambda: _service(proc.state_dir) >= 1.5, timeout=8, what="its charge saved (not 30 passes later)")
    proc.kill9()
    proc.start()
    assert _service(proc.state_dir) >= 1.5
    proc.terminate()


def test_a_job_that_ended_while_the_daemon_was_down_is_charged_for_the_downtime(
        daemon_process: Callable[..., DaemonProcess]) -> None:
    proc = daemon_process(sim="H100-80GB:1").start()
    with Client(proc.socket) as c:
        submit(c, spec("sleep", "6"))
    wait_until(lambda: _state(proc.state_dir, 1) == "RUNNING", timeout=20, what="running")
    assert proc.terminate() == 0  # a graceful stop: the job runs on under its shim
    status = os.path.join(proc.state_dir, "jobs", "1", "status.json")
    wait_until(lambda: os.path.exists(status), timeout=20, what="the job ending while no daemon runs")
    proc.start()
    wait_until(lambda: _state(proc.state_dir, 1) == "COMPLETED", timeout=20, what="recorded COMPLETED")
    assert proc.terminate() == 0
    assert _service(proc.state_dir) >= 5.0, f"{_service(proc.state_dir):.2f} GPU-s charged for a 6 s whole-GPU job"
