"""dcgm-exporter HPC job-mapping files, so GPU metrics can be labelled with the job using them.

dcgm-exporter's `--hpc-job-mapping-dir` (or DCGM_HPC_JOB_MAPPING_DIR) reads one file per device:
named by the GPU index (`0`, `1`, ...) or, for a MIG device, `GPU.GI` (e.g. `2.1`, GPU 2's GPU
instance 1), each holding the ids of the jobs on that device, one per line (dcgm-exporter README,
"Include HPC Job Information in Metric Labels"). We rewrite the directory whenever an allocation
changes; each file is replaced atomically so the exporter never reads half a file.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping

from gpusched.gpu.backend import Gpu
from gpusched.model import Job


def device_file_names(gpus: Iterable[Gpu]) -> dict[str, str]:
    """Device UUID -> mapping-file name: `INDEX` for a GPU, `INDEX.GI` for a MIG instance."""
    names: dict[str, str] = {}
    for gpu in gpus:
        names[gpu.uuid] = str(gpu.index)
        for inst in gpu.instances:
            names[inst.uuid] = f"{gpu.index}.{inst.gi_id}"
    return names


def job_mapping(gpus: Iterable[Gpu], jobs: Iterable[Job]) -> dict[str, list[int]]:
    """File name -> job ids, for every job that holds a device."""
    names = device_file_names(gpus)
    mapping: dict[str, list[int]] = {}
    for job in jobs:
        if job.allocation is None:
            continue
        for uuid in job.allocation.uuids:
            if uuid in names:
                mapping.setdefault(names[uuid], []).append(job.id)
    return mapping


def write_job_mapping(directory: str, mapping: Mapping[str, list[int]]) -> None:
    """Make `directory` hold exactly `mapping`: changed files replaced, stale ones removed."""
    os.makedirs(directory, mode=0o755, exist_ok=True)
    for name, job_ids in mapping.items():
        content = "".join(f"{j}\n" for j in sorted(job_ids))
        path = os.path.join(directory, name)
        with contextlib.suppress(FileNotFoundError), open(path) as f:
            if f.read() == content:
                continue
        tmp = os.path.join(directory, f".{name}.tmp")
        with open(tmp, "w") as f:
            f.write(content)
        os.chmod(tmp, 0o644)
        os.rename(tmp, path)
    for name in os.listdir(directory):
        if name not in mapping and not name.startswith("."):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))
