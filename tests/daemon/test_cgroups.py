"""Per-job cgroups, tested against a temporary directory laid out like cgroupfs (never the real one)."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpusched.daemon.cgroups import CgroupError, CgroupManager, JobLimits, format_cpu_list, own_cgroup
from gpusched.model import Job, JobState
from gpusched.protocol import CancelRequest, CancelResult, ShowRequest, ShowResult
from gpusched_cli.client import Client
from tests.conftest import wait_until
from tests.integration.test_daemon import spec, submit, wait_done


def fake_cgroupfs(root: Path, controllers: str = "cpuset cpu io memory pids") -> Path:
    """The files a delegated cgroup v2 directory has, as plain files."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "cgroup.controllers").write_text(controllers + "\n")
    (root / "cgroup.subtree_control").write_text("")
    (root / "cgroup.procs").write_text("")
    return root


def test_setup_moves_the_daemon_into_a_leaf_and_delegates_controllers(tmp_path: Path) -> None:
    root = fake_cgroupfs(tmp_path / "gpusched.service", controllers="cpu io memory pids")
    manager = CgroupManager(str(root))
    manager.setup(daemon_pid=4242)
    assert (root / "daemon" / "cgroup.procs").read_text() == "4242"
    assert (root / "cgroup.subtree_control").read_text() == "+cpu +memory"
    assert manager.missing() == ["cpuset"]


def test_job_cgroup_gets_its_limits_and_is_removed_when_empty(tmp_path: Path) -> None:
    manager = CgroupManager(str(fake_cgroupfs(tmp_path / "svc")))
    manager.setup(daemon_pid=1)
    path = Path(manager.create(7, JobLimits(cpus=2, mem_bytes=1 << 30, cpuset=(0, 1, 2, 5))))
    assert (path / "memory.max").read_text() == str(1 << 30)
    assert (path / "memory.swap.max").read_text() == "0"
    assert (path / "cpu.max").read_text() == "200000 100000"
    assert (path / "cpuset.cpus").read_text() == "0-2,5"
    (path / "cgroup.procs").write_text("999\n")
    assert manager.remove(7) is False  # processes left: keep it so nothing escapes accounting
    (path / "cgroup.procs").write_text("")
    assert manager.remove(7) is True
    assert not path.exists()


def test_unwritable_root_is_refused_with_a_reason(tmp_path: Path) -> None:
    with pytest.raises(CgroupError, match="Delegate=yes"):
        CgroupManager(str(tmp_path / "missing")).setup(daemon_pid=1)


def test_own_cgroup_reads_the_v2_line(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("0::/system.slice/gpusched.service\n")
    assert own_cgroup(str(proc), "/sys/fs/cgroup") == "/sys/fs/cgroup/system.slice/gpusched.service"
    proc.write_text("1:name=systemd:/x\n")
    assert own_cgroup(str(proc)) is None


@given(st.sets(st.integers(min_value=0, max_value=256), min_size=1))
def test_cpu_list_format_round_trips(cpus: set[int]) -> None:
    parsed: set[int] = set()
    for part in format_cpu_list(cpus).split(","):
        lo, _, hi = part.partition("-")
        parsed.update(range(int(lo), int(hi or lo) + 1))
    assert parsed == cpus


def test_daemon_puts_each_job_in_its_own_cgroup(daemon_factory: Any, tmp_path: Path) -> None:
    root = fake_cgroupfs(tmp_path / "gpusched.service")
    daemon = daemon_factory(cgroup_root=str(root))
    with daemon.client() as c:
        job_id = submit(c, spec("sleep", "30", cpus=2, mem_mib=512))
        job_dir = root / f"job-{job_id}"
        job = wait_until(lambda: _running(c, job_id), what="job running")
        assert (job_dir / "cgroup.procs").read_text() == str(job.pid)  # joined before exec
        assert (job_dir / "memory.max").read_text() == str(512 << 20)
        assert (job_dir / "cpu.max").read_text() == "200000 100000"
        assert (root / "daemon" / "cgroup.procs").read_text() == str(os.getpid())
        (job_dir / "cgroup.procs").write_text("")  # what the kernel does once the job's processes exit
        c.call(CancelRequest(job_ids=[job_id]), CancelResult)
        assert wait_done(c, job_id).job.state is JobState.CANCELLED
        wait_until(lambda: not job_dir.exists(), what="job cgroup removed")


def _running(c: Client, job_id: int) -> Job | None:
    job = c.call(ShowRequest(job_id=job_id), ShowResult).job
    return job if job.state is JobState.RUNNING else None


def test_a_cgroup_still_busy_after_the_kill_is_left_for_later_not_raised(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Right after cgroup.kill, real cgroupfs answers rmdir with EBUSY while the killed tasks exit
    (cgroup.procs already hides them): remove() raised it into the job's end, so a preempted job
    was never requeued (isolation audit). It says False now, as for a cgroup with processes left."""
    manager = CgroupManager(str(fake_cgroupfs(tmp_path / "gpusched.service")))
    manager.setup(daemon_pid=1)
    manager.create(7, JobLimits(cpus=1))

    def busy(path: str, *args: object, **kwargs: object) -> None:
        raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), path)

    monkeypatch.setattr(os, "rmdir", busy)
    assert manager.remove(7) is False
