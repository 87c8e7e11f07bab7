"""The shim, run on its own as the daemon runs it (`python -I shim.py JOB_DIR`), with no daemon."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gpusched.daemon import shim


def _job_dir(tmp_path: Path) -> Path:
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / shim.LAUNCH).write_text(json.dumps({
        "argv": ["sh", "-c", f"echo ran > {tmp_path}/marker; exit 3"], "env": {"PATH": "/usr/bin:/bin"},
        "cwd": str(tmp_path), "log_path": str(tmp_path / "job.log"), "cgroup": None, "cpuset": None,
        "drop_privileges": False,
    }))
    return job_dir


def test_a_shim_whose_daemon_died_still_records_the_jobs_end(tmp_path: Path) -> None:
    """A daemon killed (kill -9) while its job was starting closed the read end of the shim's report
    pipe. The shim had reset SIGPIPE to its default with every other ignored signal, so its report
    killed it: the job ran, but no status.json was written and the restarted daemon called it LOST
    (found by tests/integration/test_crash.py)."""
    job_dir = _job_dir(tmp_path)
    read_fd, write_fd = os.pipe()
    proc = subprocess.Popen([sys.executable, "-I", shim.__file__, str(job_dir)], stdin=subprocess.DEVNULL,
                            stdout=write_fd, start_new_session=True)
    os.close(write_fd)
    os.close(read_fd)  # the daemon is gone before the shim's first report: no reader is left
    assert proc.wait(timeout=60) == 0
    assert (tmp_path / "marker").read_text() == "ran\n"
    status = json.loads((job_dir / shim.STATUS).read_text())
    assert status["exit_code"] == 3 and status["error"] is None, status
