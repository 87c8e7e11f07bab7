"""The launch path: what a job starts with, and starting it.

`Launcher` starts a job's processes once the engine has committed it STARTING: the MPS control
daemon of a share, the cgroup and CPU limits, then the shim, with a deadline. It decides nothing
and records nothing: the engine calls it off the scheduling pass and records what comes back. The
functions below it (identity, environment, limits, GPU-memory readings) are pure functions of the
job, its allocation and the node, so each can be read and tested on its own.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import pwd
import threading
from collections.abc import Callable, Sequence

from gpusched.config import DaemonConfig
from gpusched.daemon.cgroups import CgroupManager, JobLimits
from gpusched.daemon.executor import Executor, Identity, Started
from gpusched.daemon.procfs import session_members, session_of
from gpusched.gpu.backend import Gpu, GpuBackend, GpuError, Inventory
from gpusched.gpu.mps_manager import MpsManager
from gpusched.model import ACTIVE_STATES, Allocation, Job

DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"

log = logging.getLogger("gpusched.launch")


class LaunchFailed(Exception):
    """The job could not be launched (a bad limit, a vanished user, ...); the message is its reason."""


class Launcher:
    """Starts jobs' processes; one per daemon. Blocking work runs off the loop, and the shim's part
    (which runs as the job's user) has a deadline."""

    def __init__(self, config: DaemonConfig, executor: Executor, cgroups: CgroupManager | None) -> None:
        self.executor = executor
        self.cgroups = cgroups
        self.mps = MpsManager(os.path.join(config.state_dir, "mps"), control_binary=mps_control_binary(config))
        self.in_flight: set[int] = set()  # jobs whose launch has begun and not yet returned
        # (device, uid) -> shares between share_env and their STARTING: a stop of that user's control
        # daemon there, decided when their last share ended, must keep it for them (mps_idle)
        self.mps_starting: dict[tuple[str, int], int] = {}
        # (device, uid) -> job -> (thread percentage, MiB) of each share of that user there, starting
        # or running: their sum is what the user's control daemon caps any one client at (share_env).
        # Read from the MPS worker threads, so guarded.
        self._mps_grants: dict[tuple[str, int], dict[int, tuple[int, int | None]]] = {}
        self._grants_lock = threading.Lock()

    def mps_started(self, allocation: Allocation, uid: int) -> None:
        """The share whose control daemon share_env ensured is now recorded (or failed)."""
        if allocation.share is not None and len(allocation.devices) == 1:
            key = (allocation.devices[0].uuid, uid)
            left = self.mps_starting.get(key, 0) - 1
            if left > 0:
                self.mps_starting[key] = left
            else:
                self.mps_starting.pop(key, None)

    async def share_env(self, job_id: int, allocation: Allocation, share_modes: dict[str, str],
                        uid: int) -> dict[str, str]:
        """For a share on an `mps` device: start (or reuse) the user's control daemon there and give
        the job its caps. One daemon per user and device, so several users' shares can be co-resident.

        The job's own variables are not the cap: a client can lower them, and one that sets its own
        (a script that exports CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100) would get what it asked. So the
        daemon's defaults, and its running server's limits, are the user's total there: all their
        shares on the device together, which is what they were given (docs/security.md).

        Raises GpuError (the control program failed, or cannot be run at all)."""
        if allocation.share is None or len(allocation.devices) != 1:
            return {}
        uuid = allocation.devices[0].uuid
        if share_modes.get(uuid) != "mps":
            return {}
        key = (uuid, uid)
        percent, mib = share_caps(allocation)
        self._grant(key, job_id, percent, mib)
        self.mps_starting[key] = self.mps_starting.get(key, 0) + 1  # the caller calls mps_started() after
        try:
            daemon = await asyncio.to_thread(functools.partial(self.mps.ensure, uuid, uid,
                                                               caps=functools.partial(self.mps_caps, key)))
        except BaseException:
            self._revoke(key, job_id)
            raise
        return daemon.client_env(percent, mib)

    def adopt_mps(self, job_id: int, allocation: Allocation, share_modes: dict[str, str], uid: int) -> bool:
        """A share found running at start (re-adopted): count its caps, and know its user's control
        daemon there, so that daemon is quit when their last share on the device ends. True if it
        is an MPS share."""
        if allocation.share is None or len(allocation.devices) != 1:
            return False
        uuid = allocation.devices[0].uuid
        if share_modes.get(uuid) != "mps":
            return False
        self._grant((uuid, uid), job_id, *share_caps(allocation))
        self.mps.daemon(uuid, uid)
        return True

    def mps_caps(self, key: tuple[str, int]) -> tuple[int, int | None] | None:
        """(thread percentage, MiB) the user's control daemon on the device caps a client at: the sum
        of their shares there (at most 100%; MiB None if one has no memory cap), or None when they
        have none."""
        with self._grants_lock:
            grants = list(self._mps_grants.get(key, {}).values())
        if not grants:
            return None
        mibs = [m for _, m in grants]
        return min(100, sum(p for p, _ in grants)), None if None in mibs else sum(m for m in mibs if m is not None)

    def _grant(self, key: tuple[str, int], job_id: int, percent: int, mib: int | None) -> None:
        with self._grants_lock:
            self._mps_grants.setdefault(key, {})[job_id] = (percent, mib)

    def _revoke(self, key: tuple[str, int], job_id: int) -> bool:
        """Forget the job's share in the user's caps there; True if the user still has shares there."""
        with self._grants_lock:
            grants = self._mps_grants.get(key)
            if grants is None:
                return False
            grants.pop(job_id, None)
            if not grants:
                del self._mps_grants[key]
                return False
            return True

    def mps_ended(self, ended: Job) -> list[tuple[str, int]]:
        """`ended`'s share is over: the (device, uid) whose control daemon must lower its caps now
        (the user has other shares there; with none left, idle_mps quits the daemon instead)."""
        if ended.allocation is None or ended.allocation.share is None:
            return []
        return [(uuid, ended.uid) for uuid in ended.allocation.uuids if self._revoke((uuid, ended.uid), ended.id)]

    async def update_mps_caps(self, uuid: str, uid: int) -> None:
        try:
            await asyncio.to_thread(self.mps.update_caps, uuid, uid, functools.partial(self.mps_caps, (uuid, uid)))
        except GpuError as exc:
            log.warning("lowering the MPS caps of uid %d on %s: %s", uid, uuid, exc.message)

    async def start(self, job: Job, allocation: Allocation, added: dict[str, str], inventory: Inventory,
                    deadline_s: float, on_pid: Callable[[int], None]) -> Started:
        """Limits, then the shim. Raises LaunchFailed for anything about this job that stops it."""
        self.in_flight.add(job.id)
        try:
            who = identity(job)
            cgroup, cpuset = cpu_and_memory_limits(job, allocation, inventory, self.cgroups)
            return await self.executor.start(job.id, job.spec.argv, job.spec.cwd, job_env(job, added), who,
                                             cgroup, cpuset, deadline_s=deadline_s, on_pid=on_pid)
        except asyncio.CancelledError:
            raise  # daemon shutdown: the shim carries on, and recovery finds it
        except Exception as exc:  # whatever it is, it is this job's: it fails, nothing else does
            log.warning("job %d: launch failed: %s", job.id, describe(exc))
            raise LaunchFailed(f"could not launch: {describe(exc)}") from exc
        finally:
            self.in_flight.discard(job.id)

    def idle_mps(self, ended: Job, active: list[Job]) -> list[str]:
        """Devices where `ended`'s user's MPS control daemon can quit now that its share is over."""
        if ended.allocation is None or ended.allocation.share is None:
            return []
        servers = set(self.mps.servers())
        return [uuid for uuid in ended.allocation.uuids if (uuid, ended.uid) in servers and not any(
                j.id != ended.id and j.uid == ended.uid and j.state in ACTIVE_STATES and j.allocation is not None
                and uuid in j.allocation.uuids for j in active)]

    async def stop_mps(self, uuid: str, uid: int | None, still_idle: Callable[[], bool] | None = None) -> None:
        try:
            await asyncio.to_thread(functools.partial(self.mps.stop, uuid, uid, still_idle=still_idle))
        except GpuError as exc:
            log.warning("stopping the MPS control daemon of %s (uid %s): %s", uuid, uid, exc.message)


def share_caps(allocation: Allocation) -> tuple[int, int | None]:
    """(thread percentage, MiB) of one MPS share: its fraction of the SMs (1..100) and its memory
    (None: no memory cap, which only a record from before shares had one can lack)."""
    return max(1, min(100, round((allocation.share or 0.0) * 100))), allocation.gpu_mem_mib


def describe(exc: BaseException) -> str:
    """An exception as one short line for a job's reason (a 4,300-digit number stays a reason, not a crash)."""
    try:
        text = str(exc) or type(exc).__name__
    except ValueError:
        text = type(exc).__name__
    return text if len(text) <= 300 else text[:300] + "..."


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


def allocation_env(job: Job, allocation: Allocation, config: DaemonConfig, gpus: Sequence[Gpu] = ()) -> dict[str, str]:
    """What gpusched adds to the job's environment for this allocation (`show` lists it). `gpus`
    (the inventory) says whether the devices are AMD logical GPUs, which get ROCm's variables."""
    amd = _on_amd(allocation, gpus)
    env = {k: v for k, v in allocation.env.items() if not (amd and k.startswith("NVIDIA_"))}
    if config.cuda_device_max_connections is not None and not amd:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = str(config.cuda_device_max_connections)
    env |= visible_devices_env(allocation, amd)
    env["GPUSCHED_JOB_ID"] = str(job.id)
    env["GPUSCHED_ALLOCATION"] = allocation.model_dump_json(exclude={"env"})
    return env


# The variables that choose the GPUs a program sees: CUDA's, and ROCm's (ROCr runtime, HIP, and
# ROCclr's for HIP and OpenCL). gpusched owns them: a submitter's own never reach a job.
VISIBILITY_VARS = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL")


def _on_amd(allocation: Allocation, gpus: Sequence[Gpu]) -> bool:
    amd = {g.index for g in gpus if g.vendor == "amd"}
    return bool(allocation.devices) and all(d.gpu_index in amd for d in allocation.devices)


def visible_devices_env(allocation: Allocation, amd: bool) -> dict[str, str]:
    """NVIDIA: CUDA_VISIBLE_DEVICES with the device UUIDs (a MIG instance is reachable only by its).
    AMD: ROCR_VISIBLE_DEVICES with the logical GPUs' indices, and HIP_VISIBLE_DEVICES 0..n-1.
    Indices, not UUIDs: amdsmi gives every partition of a physical GPU the same UUID, so a UUID
    cannot name one logical GPU; the index is amdsmi's enumeration order, which is the driver's (KFD)
    order ROCr enumerates in (docs/gpu.md, "What a job sees on AMD"). HIP numbers what ROCr left
    visible, so its list is 0..n-1: set, it overrides a stale value the job may have inherited."""
    if not amd:
        return {"CUDA_VISIBLE_DEVICES": ",".join(allocation.uuids)}
    return {"ROCR_VISIBLE_DEVICES": ",".join(str(d.gpu_index) for d in allocation.devices),
            "HIP_VISIBLE_DEVICES": ",".join(str(i) for i in range(len(allocation.devices)))}


# Variables gpusched sets for an allocation, an MPS share or an array task: a submitter's own (a job
# that submits jobs, from inside a share or an array task) must not reach a job that is not one.
_OWNED_PREFIXES = ("GPUSCHED_", "CUDA_MPS_")


def job_env(job: Job, added: dict[str, str]) -> dict[str, str]:
    """Login defaults, then the submitter's exported environment less the variables gpusched owns,
    then what gpusched adds for this job.

    The defaults mean `--export NONE` still gives a job HOME, USER, LOGNAME, SHELL and PATH.
    """
    exported = {k: v for k, v in job.spec.env.items()
                if not k.startswith(_OWNED_PREFIXES) and k not in VISIBILITY_VARS}
    return login_defaults(job) | exported | added


def login_defaults(job: Job) -> dict[str, str]:
    try:
        entry = pwd.getpwuid(job.uid)
    except KeyError:
        return {"PATH": DEFAULT_PATH, "HOME": "/", "USER": job.user, "LOGNAME": job.user, "SHELL": "/bin/sh"}
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
        cgroup = cgroups.create(job.id, JobLimits(cpus=job.spec.cpus, mem_bytes=mem, cpuset=pool))
        if {"cpu", "cpuset"} & set(cgroups.controllers):
            return cgroup, ()
        # a cgroup without the CPU controllers (the parent does not delegate them) limits no CPU:
        # the job is pinned as without a cgroup, as the user guide says
        return cgroup, pool[: job.spec.cpus] if job.spec.cpus else pool
    # No cgroup: pin to CPUs near the GPU, and to at most --cpus of them (memory is not enforced).
    return None, pool[: job.spec.cpus] if job.spec.cpus else pool


def gpu_memory_by_job(backend: GpuBackend, jobs: list[Job], cgroups: CgroupManager | None = None) -> dict[int, int]:
    """MiB of GPU memory each job's processes use, per NVML. A process belongs to the job whose
    cgroup holds it (with per-job cgroups: a job cannot leave its own), else to the job whose session
    it is in (every job is a session leader; a process that calls setsid() leaves it, so without
    cgroups such a process is not counted). Blocking: run it off the loop."""
    by_session = {j.pid: j.id for j in jobs if j.pid}
    by_cgroup = {pid: j.id for j in jobs for pid in cgroups.procs(j.id)} if cgroups is not None else {}
    devices = {u for j in jobs if j.allocation is not None for u in j.allocation.uuids}
    used: dict[int, int] = {}
    for uuid in devices:
        try:
            procs = backend.processes(uuid)
        except GpuError:
            continue
        for p in procs:
            job_id = by_cgroup.get(p.pid)
            if job_id is None:
                job_id = by_session.get(session_of(p.pid) or -1)
            if job_id is not None and p.used_memory_bytes is not None:
                used[job_id] = used.get(job_id, 0) + p.used_memory_bytes // 2**20
    return used


def cuda_pids(backend: GpuBackend, job: Job) -> list[int]:
    """The job's processes that NVML lists on its devices (in its session), for cuda-checkpoint;
    every live process of its session when NVML lists none (simulated GPUs run no CUDA, and the
    simulated tool takes any process for a CUDA one: checkpointing only the leader let a worker child
    run on with its GPU given away). Blocking: run it off the loop."""
    found: set[int] = set()
    for uuid in job.allocation.uuids if job.allocation is not None else ():
        try:
            procs = backend.processes(uuid)
        except GpuError:
            continue
        found.update(p.pid for p in procs if job.pid and session_of(p.pid) == job.pid)
    if found or not job.pid:
        return sorted(found)
    return sorted(set(session_members(job.pid)) | {job.pid})


def mps_control_binary(config: DaemonConfig) -> str:
    """The configured MPS control program; on simulated GPUs, the simulated one (gpu/simmps.py)."""
    if config.mps_control is not None:
        return config.mps_control
    if config.sim:
        from gpusched.gpu import simmps

        return simmps.__file__
    return "nvidia-cuda-mps-control"
