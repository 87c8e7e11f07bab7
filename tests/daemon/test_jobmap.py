"""dcgm-exporter job-mapping files: names per device, contents, atomic replacement, stale removal."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from gpusched.daemon.jobmap import device_file_names, write_job_mapping
from gpusched.gpu.backend import Gpu, Instance
from gpusched.model import JobState
from gpusched.protocol import ShowRequest, ShowResult
from tests.conftest import wait_until
from tests.integration.test_daemon import spec, submit, wait_done


def test_file_names_follow_dcgm_exporter_conventions() -> None:
    inst = Instance(uuid="MIG-a", gpu_index=2, profile="3g.40gb", profile_id=9, gi_id=1, ci_id=0, start=4,
                    size=4, memory_mib=40000, sm_count=60)
    gpus = [Gpu(index=0, uuid="GPU-0", name="x", model="H100-80GB", memory_total_mib=1, sm_count=132,
                mig_enabled=False, mig_pending=False),
            Gpu(index=2, uuid="GPU-2", name="x", model="H100-80GB", memory_total_mib=1, sm_count=132,
                mig_enabled=True, mig_pending=True, instances=(inst,))]
    assert device_file_names(gpus) == {"GPU-0": "0", "GPU-2": "2", "MIG-a": "2.1"}


def test_directory_holds_exactly_the_mapping(tmp_path: Path) -> None:
    write_job_mapping(str(tmp_path), {"0": [5, 3], "1.2": [9]})
    assert (tmp_path / "0").read_text() == "3\n5\n"
    assert (tmp_path / "1.2").read_text() == "9\n"
    write_job_mapping(str(tmp_path), {"1.2": [9]})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1.2"]


def test_daemon_maintains_mapping_files(daemon_factory: Any, tmp_path: Path) -> None:
    mapping = tmp_path / "dcgm-job-map"
    daemon = daemon_factory(job_mapping_dir=str(mapping))
    with daemon.client() as c:
        job_id = submit(c, spec("sleep", "0.5"))
        wait_until(lambda: c.call(ShowRequest(job_id=job_id), ShowResult).job.state is JobState.RUNNING,
                   what="running")
        gpu = c.call(ShowRequest(job_id=job_id), ShowResult).job.allocation.devices[0].gpu_index  # type: ignore[union-attr]
        assert (mapping / str(gpu)).read_text() == f"{job_id}\n"
        wait_done(c, job_id)
        wait_until(lambda: not (mapping / str(gpu)).exists(), what="mapping removed after the job")


def test_planted_symlinks_are_never_followed(tmp_path: Path) -> None:
    """A `.0.tmp` (or `0`) symlink to a root-only file must not make root truncate or chmod that file."""
    victim = tmp_path / "victim"
    victim.write_text("secret\n")
    victim.chmod(0o600)
    mapping = tmp_path / "map"
    mapping.mkdir(mode=0o755)
    (mapping / ".0.tmp").symlink_to(victim)
    (mapping / "1").symlink_to(victim)
    write_job_mapping(str(mapping), {"0": [7], "1": [8]})
    assert victim.read_text() == "secret\n" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert (mapping / "0").read_text() == "7\n" and not (mapping / "0").is_symlink()
    assert (mapping / "1").read_text() == "8\n" and not (mapping / "1").is_symlink()


def test_only_mapping_files_are_removed(tmp_path: Path) -> None:
    """Stale removal deletes only names we write (`N`, `N.M`): a mis-pointed directory loses nothing else."""
    (tmp_path / "passwd").write_text("keep\n")
    (tmp_path / "3").write_text("old\n")
    write_job_mapping(str(tmp_path), {"0": [1]})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "passwd"]


@pytest.mark.parametrize("problem", ["other owner", "world-writable", "symlinked dir", "symlinked parent"])
def test_a_directory_another_user_controls_is_refused(tmp_path: Path, problem: str) -> None:
    if os.geteuid() != 0 and problem == "other owner":
        pytest.skip("needs root to give the directory to another uid")
    real = tmp_path / "real"
    real.mkdir(mode=0o755)
    target = real
    if problem == "other owner":
        os.chown(real, 4242, 4242)
    elif problem == "world-writable":
        real.chmod(0o777)
    elif problem == "symlinked dir":
        target = tmp_path / "link"
        target.symlink_to(real)
    else:
        (tmp_path / "linkparent").symlink_to(tmp_path)
        target = tmp_path / "linkparent" / "real"
    with pytest.raises(OSError, match="refusing"):
        write_job_mapping(str(target), {"0": [1]})
    assert list(real.iterdir()) == []
