"""Per-job cgroup v2 limits in the subtree systemd delegates to us (`Delegate=yes`).

cgroup v2's "no internal processes" rule means a cgroup that holds processes cannot hand
controllers to its children. So, like other delegated managers, the daemon first moves itself into
a leaf (`ROOT/daemon`), enables the controllers in `ROOT/cgroup.subtree_control`, and then creates
one sibling per job (`ROOT/job-ID`) with `memory.max`, `cpu.max` and `cpuset.cpus`. The shim moves
the job into its cgroup before exec, so not one instruction of the job runs outside it.

Everything goes through plain file operations on `root`, so tests use a temporary directory laid
out like cgroupfs and never touch the machine's real hierarchy.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterable
from dataclasses import dataclass

CPU_PERIOD_US = 100_000
WANTED_CONTROLLERS = ("cpu", "cpuset", "memory")


MAX_LIMIT = 2**63  # cgroup v2 limits are signed 64-bit


class CgroupError(Exception):
    """The cgroup subtree cannot be used as configured."""


@dataclass(frozen=True, slots=True)
class JobLimits:
    cpus: int | None = None  # cores of CPU time (cpu.max quota)
    mem_bytes: int | None = None  # memory.max
    cpuset: tuple[int, ...] = ()  # CPUs the job may run on (near its GPU)


def own_cgroup(proc_self_cgroup: str = "/proc/self/cgroup", mount: str = "/sys/fs/cgroup") -> str | None:
    """This process's cgroup v2 directory, or None on a v1/hybrid-only system."""
    try:
        with open(proc_self_cgroup) as f:
            for line in f:
                hierarchy, _, path = line.rstrip("\n").partition("::")
                if hierarchy == "0":
                    return os.path.join(mount, path.lstrip("/"))
    except OSError:
        return None
    return None


class CgroupManager:
    """Creates, fills and removes job cgroups below a delegated root."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.controllers: tuple[str, ...] = ()

    def setup(self, daemon_pid: int) -> None:
        """Move the daemon into its leaf and enable the controllers we use for children."""
        if not os.access(self.root, os.W_OK):
            raise CgroupError(f"{self.root} is not writable (run as a systemd service with Delegate=yes)")
        available = _read(os.path.join(self.root, "cgroup.controllers")).split()
        self.controllers = tuple(c for c in WANTED_CONTROLLERS if c in available)
        leaf = os.path.join(self.root, "daemon")
        os.makedirs(leaf, exist_ok=True)
        _write(os.path.join(leaf, "cgroup.procs"), str(daemon_pid))
        if self.controllers:
            _write(os.path.join(self.root, "cgroup.subtree_control"), " ".join(f"+{c}" for c in self.controllers))

    def missing(self) -> list[str]:
        """Controllers we would use but the delegated subtree does not offer (for `doctor`)."""
        return [c for c in WANTED_CONTROLLERS if c not in self.controllers]

    def job_path(self, job_id: int) -> str:
        return os.path.join(self.root, f"job-{job_id}")

    def create(self, job_id: int, limits: JobLimits) -> str:
        """Make the job's cgroup and write its limits; returns the directory the shim joins."""
        if limits.mem_bytes is not None and not 0 < limits.mem_bytes < MAX_LIMIT:
            # Checked before anything is written (and the number never printed: a 4,300-digit int
            # cannot even be turned into a string).
            raise CgroupError("mem_mib: more memory than the kernel can limit (memory.max takes at most 2^63-1 bytes)")
        path = self.job_path(job_id)
        os.makedirs(path, exist_ok=True)
        if limits.mem_bytes is not None and "memory" in self.controllers:
            _write(os.path.join(path, "memory.max"), str(limits.mem_bytes))
            _write(os.path.join(path, "memory.swap.max"), "0")  # a GPU job that swaps only looks alive
        if limits.cpus is not None and "cpu" in self.controllers:
            _write(os.path.join(path, "cpu.max"), f"{limits.cpus * CPU_PERIOD_US} {CPU_PERIOD_US}")
        if limits.cpuset and "cpuset" in self.controllers:
            _write(os.path.join(path, "cpuset.cpus"), format_cpu_list(limits.cpuset))
        return path

    def procs(self, job_id: int) -> list[int]:
        """The pids in the job's cgroup: every process of the job, including one that left its
        session (`setsid`), since a job cannot leave a cgroup it does not own. [] without one."""
        try:
            text = _read(os.path.join(self.job_path(job_id), "cgroup.procs"))
        except OSError:
            return []
        return [int(tok) for tok in text.split() if tok.isdigit()]

    def kill(self, job_id: int) -> None:
        """SIGKILL everything in the job's cgroup, including processes that left its process group."""
        path = os.path.join(self.job_path(job_id), "cgroup.kill")
        if os.path.exists(path):  # cgroup v2 since Linux 5.14
            with contextlib.suppress(OSError):
                _write(path, "1")

    def remove(self, job_id: int) -> bool:
        """Remove an emptied job cgroup; False (and left in place) while processes remain."""
        path = self.job_path(job_id)
        if not os.path.isdir(path):
            return True
        if _read(os.path.join(path, "cgroup.procs")).split():
            return False
        try:
            # In real cgroupfs rmdir removes the interface files with the directory; in a test tree
            # they are ordinary files and must go first.
            if not _is_cgroupfs(path):
                for name in os.listdir(path):
                    os.unlink(os.path.join(path, name))
            os.rmdir(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            # Just after cgroup.kill, tasks still exiting are no longer in cgroup.procs but keep the
            # cgroup populated: EBUSY. Left in place (the caller logs it), never raised into a job's end.
            if exc.errno in (errno.EBUSY, errno.ENOTEMPTY):
                return False
            raise
        return True


def format_cpu_list(cpus: Iterable[int]) -> str:
    """`[0, 1, 2, 5]` -> `0-2,5`, the cpuset list format."""
    ordered = sorted(set(cpus))
    ranges: list[str] = []
    start = prev = None
    for cpu in ordered:
        if start is None:
            start = prev = cpu
        elif prev is not None and cpu == prev + 1:
            prev = cpu
        else:
            ranges.append(f"{start}-{prev}" if start != prev else f"{start}")
            start = prev = cpu
    if start is not None:
        ranges.append(f"{start}-{prev}" if start != prev else f"{start}")
    return ",".join(ranges)


def _is_cgroupfs(path: str) -> bool:
    """Is `path` on a mounted cgroup2 filesystem (rather than a test tree laid out like one)?"""
    best, fstype = "", ""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                mount_point, sep = fields[4], fields.index("-")
                if (path == mount_point or path.startswith(mount_point.rstrip("/") + "/")) \
                        and len(mount_point) > len(best):
                    best, fstype = mount_point, fields[sep + 1]
    except OSError:
        return False
    return fstype == "cgroup2"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _write(path: str, value: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(value)
    except OSError as exc:
        raise CgroupError(f"cannot write {value!r} to {path}: {exc.strerror}") from None
