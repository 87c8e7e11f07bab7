"""`gpusched doctor`: the checks an admin would otherwise run by hand, each with a fix hint.

Runs inside the daemon, which holds the driver and sees what the scheduler relies on. Checks only
read; none changes anything. Blocking (NVML and /proc reads): run it off the event loop.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from typing import TYPE_CHECKING, Literal

import gpusched.core
from gpusched import native
from gpusched.daemon import shim
from gpusched.daemon.procfs import session_of
from gpusched.gpu.backend import GpuError
from gpusched.gpu.profiles import MODELS
from gpusched.protocol import DoctorCheck

if TYPE_CHECKING:
    from gpusched.daemon.engine import Engine

Status = Literal["PASS", "WARN", "FAIL"]
PASS: Status = "PASS"
WARN: Status = "WARN"
FAIL: Status = "FAIL"


def run_checks(engine: Engine, socket_path: str) -> list[DoctorCheck]:
    checks: list[DoctorCheck] = []
    checks += _driver(engine)
    checks += _drains(engine)
    checks += _mig(engine)
    checks += _foreign_processes(engine)
    checks += _numa(engine)
    checks.append(_cgroups(engine))
    checks += _paths(engine, socket_path)
    checks += compiled_parts(native_in_use=gpusched.core.NATIVE, native_why_not=native.usable_build(),
                             execjob_in_use=shim.EXECJOB, execjob_now=shim.usable_execjob(),
                             execjob_env=os.environ.get(shim.EXECJOB_ENV, ""))
    return checks


def _check(name: str, status: Status, detail: str, hint: str = "") -> DoctorCheck:
    return DoctorCheck(name=name, status=status, detail=detail, hint=hint)


def _driver(engine: Engine) -> Iterable[DoctorCheck]:
    inv = engine.inventory
    if not inv.gpus:
        yield _check("nvml", FAIL, "no GPUs visible", "check `nvidia-smi` (NVIDIA) or `amd-smi list` (AMD); or "
                     "run gpuschedd --sim for a trial")
        return
    yield _check("amdsmi" if _amd(engine) else "nvml", PASS,
                 f"{inv.backend or 'nvml'} driver {inv.driver_version or 'unknown'}, {len(inv.gpus)} GPU(s)")
    for index, why in sorted(inv.errors.items()):
        yield _check(f"gpu{index}.readable", FAIL, why, "the GPU is unschedulable until this is fixed")


def _drains(engine: Engine) -> Iterable[DoctorCheck]:
    """A drained device runs nothing new: WARN for each, FAIL when no device can take a job at all."""
    gpus = engine.inventory.gpus
    usable = 0
    for gpu in gpus:
        devices = [(i.uuid, f"{i.profile} {i.uuid}") for i in gpu.instances] if gpu.mig_enabled else []
        why = engine.devices.drain_reason(gpu.uuid)
        if why is not None:
            yield _check(f"gpu{gpu.index}.health", WARN, f"drained: {why}",
                         f"no new job starts on it; `gpusched gpus resume {gpu.index}` puts it back once fixed")
            continue
        drained = [(name, reason) for uuid, name in devices if (reason := engine.devices.drain_reason(uuid))]
        for name, reason in drained:
            yield _check(f"gpu{gpu.index}.health", WARN, f"{name} drained: {reason}",
                         "`gpusched gpus resume UUID` puts it back once fixed")
        usable += 1 if not devices or len(drained) < len(devices) else 0
    if gpus and not usable:
        yield _check("schedulable", FAIL, "every GPU is drained or unreadable: no job can start",
                     "see the gpuN checks above")


def _amd(engine: Engine) -> bool:
    return any(g.vendor == "amd" for g in engine.inventory.gpus)


def _mig(engine: Engine) -> Iterable[DoctorCheck]:
    """NVIDIA: MIG support and pending mode changes. AMD: the partition each logical GPU is (no MIG)."""
    for gpu in engine.inventory.gpus:
        name = f"gpu{gpu.index}.mig"
        if gpu.vendor == "amd":
            p = gpu.partition
            where = (f"partition {p.index_in_physical} of {p.count} on physical GPU {p.physical_index}, "
                     f"{p.compute_mode}/{p.memory_mode}" if p is not None else "not partitioned")
            yield _check(f"gpu{gpu.index}.partition", PASS,
                         f"{gpu.model} logical GPU ({where}), {gpu.sm_count} CUs: scheduled as a whole GPU")
            continue
        if gpu.model not in MODELS:
            yield _check(name, WARN, f"{gpu.name}: no MIG profile table (MIG needs Ampere A100/A30 or newer)",
                         "whole-GPU and share jobs still work")
            continue
        if gpu.mig_enabled != gpu.mig_pending:
            want = "on" if gpu.mig_pending else "off"
            yield _check(name, WARN, f"MIG mode change to {want} is pending",
                         f"idle the GPU and reset it: `nvidia-smi -i {gpu.index} -r` (or reboot)")
        else:
            yield _check(name, PASS, f"{gpu.model} supports MIG; MIG is {'on' if gpu.mig_enabled else 'off'}")


def _foreign_processes(engine: Engine) -> Iterable[DoctorCheck]:
    """GPU processes that no gpusched job started: they block MIG (or AMD partition) changes and eat memory."""
    job_sessions = {j.pid for j in engine.jobs.values() if j.pid}
    kind = "GPU" if _amd(engine) else "CUDA"
    foreign: list[str] = []
    for gpu in engine.inventory.gpus:
        for uuid in [gpu.uuid, *(i.uuid for i in gpu.instances)]:
            try:
                procs = engine.backend.processes(uuid)
            except GpuError:
                continue
            for p in procs:
                if session_of(p.pid) not in job_sessions:
                    foreign.append(f"pid {p.pid} ({_owner(p.pid)}: {_command(p.pid)}) on GPU {gpu.index}")
    if foreign:
        yield _check("processes", WARN, f"{kind} processes not started by gpusched: " + "; ".join(sorted(set(foreign))),
                     "they block MIG changes on their GPU; ask their owners to submit through gpusched")
    else:
        yield _check("processes", PASS, f"every {kind} process belongs to a gpusched job")


def _numa(engine: Engine) -> Iterable[DoctorCheck]:
    unknown = [str(g.index) for g in engine.inventory.gpus if not g.cpu_affinity]
    if unknown:
        yield _check("numa", WARN, f"CPU affinity unknown for GPU(s) {', '.join(unknown)}",
                     "jobs on them are not pinned to near CPUs")
    else:
        yield _check("numa", PASS, "CPU affinity known for every GPU")


def _cgroups(engine: Engine) -> DoctorCheck:
    if engine.cgroups is None:
        return _check("cgroups", WARN, f"per-job cgroups off: {engine.cgroup_note}; CPU affinity only, "
                      "--mem is not enforced and --cpus only by CPU affinity",
                      "run gpuschedd as the systemd service (systemd/gpusched.service has Delegate=yes)")
    missing = engine.cgroups.missing()
    if missing:
        return _check("cgroups", WARN, f"{engine.cgroup_note}; missing controllers: {', '.join(missing)}",
                      "enable them for the delegated subtree (systemd: Delegate=yes)")
    return _check("cgroups", PASS, engine.cgroup_note)


def _paths(engine: Engine, socket_path: str) -> Iterable[DoctorCheck]:
    try:
        mode = stat.S_IMODE(os.stat(socket_path).st_mode)
        ok = mode & 0o666 == 0o666
        yield _check("socket", PASS if ok else FAIL, f"{socket_path} mode {mode:04o}",
                     "" if ok else f"chmod 0666 {socket_path}: identity comes from SO_PEERCRED, not the mode")
    except OSError as exc:
        yield _check("socket", FAIL, f"{socket_path}: {exc.strerror}")
    state_dir = os.path.dirname(engine.store.path)
    st = os.stat(state_dir)
    writable_by_others = stat.S_IMODE(st.st_mode) & 0o022
    if st.st_uid != os.geteuid() or writable_by_others:
        yield _check("state_dir", FAIL, f"{state_dir} owned by uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}",
                     f"chown {os.geteuid()} {state_dir} && chmod 0711 {state_dir}")
    else:
        yield _check("state_dir", PASS, f"{state_dir} mode {stat.S_IMODE(st.st_mode):04o}, owned by the daemon")


def compiled_parts(*, native_in_use: bool, native_why_not: str | None, execjob_in_use: str | None,
                   execjob_now: str | None, execjob_env: str) -> Iterable[DoctorCheck]:
    """The two optional compiled parts (`make` builds both). Each has a pure Python stand-in that
    does the same, slower, so a missing one is a WARN. Both are chosen once, when the daemon (and
    the fork server it starts) imports them: what is in use is what was there then, and a part
    built or rebuilt since needs a restart."""
    if native_in_use:
        yield _check("native", PASS, "the scheduling core runs compiled (mypyc)")
    elif native_why_not is None:
        yield _check("native", WARN, "the scheduling core runs as pure Python: compiled since gpuschedd started",
                     "restart gpuschedd to use it")
    else:
        yield _check("native", WARN, f"the scheduling core runs as pure Python (about half as fast a pass): "
                     f"{native_why_not}",
                     "python -m gpusched.native build (needs a C compiler and mypy), then restart gpuschedd")
    if execjob_in_use is not None:
        yield _check("execjob", PASS, f"each job's child is started by {execjob_in_use}")
    elif execjob_env == "0":
        yield _check("execjob", WARN, f"each job's child is a forked Python process: {shim.EXECJOB_ENV}=0 in "
                     "gpuschedd's environment", f"unset {shim.EXECJOB_ENV} and restart gpuschedd (~3 ms "
                     "faster starts)")
    elif execjob_now is not None:
        yield _check("execjob", WARN, f"each job's child is a forked Python process: {execjob_now} was built "
                     "after gpuschedd started", "restart gpuschedd to use it")
    else:
        yield _check("execjob", WARN, "each job's child is a forked Python process (~3 ms slower starts): the "
                     "helper is not built for this version of gpusched/daemon/execjob.c",
                     "python -m gpusched.daemon.execjob_build (needs a C compiler), then restart gpuschedd")


def _owner(pid: int) -> str:
    import pwd

    try:
        uid = os.stat(f"/proc/{pid}").st_uid
        return pwd.getpwuid(uid).pw_name
    except (OSError, KeyError):
        return "unknown user"


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:80] or "?"
    except OSError:
        return "?"
