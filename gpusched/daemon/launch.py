"""What a job starts with: its identity, environment, CPU and memory limits, and GPU-memory readings.

Pure functions of the job, its allocation and the node, kept apart from the engine (which decides
when a job starts and records what happens) so each can be read and tested on its own.
"""

from __future__ import annotations

import os
import pwd

from gpusched.config import DaemonConfig
from gpusched.daemon.cgroups import CgroupManager, JobLimits
from gpusched.daemon.executor import Identity
from gpusched.daemon.procfs import session_of
from gpusched.gpu.backend import GpuBackend, GpuError, Inventory
from gpusched.model import Allocation, Job

DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"


def identity(job: Job) -> Identity:
    """Who the job runs as: the submitter, with their groups, when the daemon is root."""
    if os.geteuid() != 0:
        return Identity(job.uid, job.gid, (), drop=False)
    try:
        name = pwd.getpwuid(job.uid).pw_name
        groups = tuple(os.getgrouplist(name, job.gid))
    except KeyError:
        groups = (job.gid,)  # a uid with no passwd entry still runs, with its primary group
    return Identity(job.uid, job.gid, groups, drop=True)


def allocation_env(job: Job, allocation: Allocation, config: DaemonConfig) -> dict[str, str]:
    """What gpusched adds to the job's environment for this allocation (`show` lists it)."""
    env = dict(allocation.env)
    if config.cuda_device_max_connections is not None:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = str(config.cuda_device_max_connections)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(allocation.uuids)
    env["GPUSCHED_JOB_ID"] = str(job.id)
    env["GPUSCHED_ALLOCATION"] = allocation.model_dump_json(exclude={"env"})
    return env


def job_env(job: Job, added: dict[str, str]) -> dict[str, str]:
    """Login defaults, then the submitter's exported environment, then what gpusched adds.

    The defaults mean `--export NONE` still gives a job HOME, USER, LOGNAME, SHELL and PATH.
    """
    return login_defaults(job) | dict(job.spec.env) | added


def login_defaults(job: Job) -> dict[str, str]:
    try:
        entry = pwd.getpwuid(job.uid)
    except KeyError:
        return {"PATH": DEFAULT_PATH, "HOME": "/", "USER": job.user, "LOGNAME": job.user}
    return {"PATH": DEFAULT_PATH, "HOME": entry.pw_dir, "USER": entry.pw_name, "LOGNAME": entry.pw_name,
            "SHELL": entry.pw_shell or "/bin/sh"}


def cpu_and_memory_limits(job: Job, allocation: Allocation, inventory: Inventory,
                          cgroups: CgroupManager | None) -> tuple[str | None, tuple[int, ...]]:
    """The job's cgroup (memory, CPU and cpuset limits) or, without one, the CPUs to pin it to."""
    gpu_indices = {d.gpu_index for d in allocation.devices}
    usable = os.sched_getaffinity(0)
    near = {c for g in inventory.gpus if g.index in gpu_indices for c in g.cpu_affinity}
    # Only CPUs we may use count (a cgroup-restricted daemon, or simulated GPUs whose topology
    # names CPUs this machine lacks); with none of the near ones usable, use them all.
    pool = tuple(sorted(near & usable or usable))
    if cgroups is not None:
        mem = job.spec.mem_mib * 2**20 if job.spec.mem_mib else None
        return cgroups.create(job.id, JobLimits(cpus=job.spec.cpus, mem_bytes=mem, cpuset=pool)), ()
    # No cgroup: pin to CPUs near the GPU, and to at most --cpus of them (memory is not enforced).
    return None, pool[: job.spec.cpus] if job.spec.cpus else pool


def gpu_memory_by_job(backend: GpuBackend, jobs: list[Job]) -> dict[int, int]:
    """MiB of GPU memory each job's processes use, per NVML (a process belongs to the job whose
    session it is in: every job is a session leader). Blocking: run it off the loop."""
    by_session = {j.pid: j.id for j in jobs if j.pid}
    devices = {u for j in jobs if j.allocation is not None for u in j.allocation.uuids}
    used: dict[int, int] = {}
    for uuid in devices:
        try:
            procs = backend.processes(uuid)
        except GpuError:
            continue
        for p in procs:
            job_id = by_session.get(session_of(p.pid) or -1)
            if job_id is not None and p.used_memory_bytes is not None:
                used[job_id] = used.get(job_id, 0) + p.used_memory_bytes // 2**20
    return used


def mps_control_binary(config: DaemonConfig) -> str:
    """The configured MPS control program; on simulated GPUs, the simulated one (gpu/simmps.py)."""
    if config.mps_control is not None:
        return config.mps_control
    if config.sim:
        from gpusched.gpu import simmps

        return simmps.__file__
    return "nvidia-cuda-mps-control"
