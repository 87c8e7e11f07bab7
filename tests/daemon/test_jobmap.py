"""dcgm-exporter job-mapping files: names per device, contents, atomic replacement, stale removal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
