"""Preemption that loses no work: checkpoint a whole-GPU job's CUDA state, give its GPU away, restore it.

When the scheduler preempts a whole-GPU job in `checkpoint` mode (core/preempt.py), the engine asks
`cuda-checkpoint` (gpu/checkpoint.py; the simulated program on `--sim`) to move the job's GPU memory
to host memory and release the GPU. The job's processes live on, SUSPENDED with no allocation: its
devices are free for the job that preempted it. The job waits in the scheduler's queue pinned to the
GPUs that hold its state (`Scheduler.pin`), and when the scheduler starts it again the engine restores
it there instead of launching anything: same process, same progress.

With moves allowed (`checkpoint_moves`: true, or "auto" on a driver r580+), it may instead resume on
any whole GPU of the same model: the restore passes `--device-map old=new,...` pairing the GPUs it
was checkpointed on with the ones it was given, in the job's order. Its environment is not changed
(CUDA_VISIBLE_DEVICES still names the old UUIDs; the driver maps them), so the record keeps the
environment it was launched with.

This module keeps what must survive a daemon restart (which jobs are checkpointed, on which GPUs
their state was taken, with what environment, and where a restore in progress is going: store meta
`checkpointed`) and runs the program; the engine decides when.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from gpusched.daemon.store import Store
from gpusched.gpu.backend import Inventory
from gpusched.gpu.checkpoint import (
    CheckpointError,
    CudaCheckpoint,
    checkpoint_binary,
    driver_can_move,
    unsupported_reason,
)
from gpusched.gpu.simcheckpoint import DIR_ENV, write_gpus
from gpusched.model import Job, JobState

MovesSetting = Literal["auto"] | bool

META_KEY = "checkpointed"
UNDERWAY_KEY = "checkpoints_underway"  # job id -> the pids a checkpoint is working on (until recorded)

log = logging.getLogger("gpusched.checkpoint")


@dataclass(frozen=True, slots=True)
class Saved:
    """One checkpointed job as kept in meta: the GPUs its state was taken on, its processes, the
    environment it was launched with, and (while a restore runs) the GPUs it is being restored on."""

    uuids: tuple[str, ...]
    pids: tuple[int, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    to: tuple[str, ...] = ()


class MoveRefused(CheckpointError):
    """A restore through a device map failed before any process of the job was restored, leaving it
    checkpointed (NVIDIA/cuda-checkpoint#35 reports same-node moves refused with "invalid argument"):
    nothing is lost, and the job may still be restored on its own GPUs without a map."""

    def __init__(self, cause: CheckpointError) -> None:
        super().__init__(cause.pid, cause.message.removeprefix(f"cuda-checkpoint on pid {cause.pid}: "),
                         cause.exit_code, cuda_error=cause.cuda_error, state=cause.state, hint=cause.hint)


class Checkpoints:
    """Which jobs are checkpointed and where they resume; the calls that checkpoint and restore them."""

    def __init__(self, store: Store, tool: CudaCheckpoint | None, *, machine: str | None = None,
                 moves: MovesSetting = "auto", sim_dir: str | None = None) -> None:
        self.store = store
        self.tool = tool
        self.machine = machine or platform.machine()
        self.moves_setting: MovesSetting = moves
        self.sim_dir = sim_dir  # the simulated program's state dir: it learns the node's GPUs there
        self.driver_version: str | None = None  # from the inventory
        self.amd = False  # the node's GPUs are AMD Instinct: cuda-checkpoint does not apply
        self._gpus_written: dict[str, str] | None = None
        self.saved: dict[int, Saved] = _load(store.get_meta(META_KEY))
        self.underway: dict[int, list[int]] = _load_underway(store.get_meta(UNDERWAY_KEY))

    @classmethod
    def from_config(cls, store: Store, *, enabled: bool, binary: str | None, timeout_s: float, sim: bool,
                    state_dir: str, moves: MovesSetting = "auto") -> Checkpoints:
        """The daemon's: off when `enabled` is false or the program cannot be run. On simulated GPUs
        the simulated program keeps its per-process state under the daemon's state dir."""
        if not enabled:
            return cls(store, None, moves=moves)
        program = checkpoint_binary(binary, sim=sim)
        env = None
        sim_dir = None
        if sim and binary is None:
            sim_dir = os.path.join(state_dir, "sim-checkpoint")
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), DIR_ENV: sim_dir}
        tool = CudaCheckpoint(program, timeout_s, env=env)
        if not tool.available():
            log.info("cuda-checkpoint (%s) is not available: preemption requeues instead of checkpointing", program)
            return cls(store, None, moves=moves)
        return cls(store, tool, moves=moves, sim_dir=sim_dir)

    @property
    def enabled(self) -> bool:
        return self.tool is not None and not self.amd

    @property
    def moves(self) -> bool:
        """May a checkpointed job be restored on other GPUs of its model? The config says, and on
        "auto" the driver: `--device-map` needs r580 (an older one would fail every moved restore)."""
        if self.tool is None or self.amd or self.moves_setting is False:
            return False
        return self.moves_setting is True or driver_can_move(self.driver_version)

    def observe(self, inventory: Inventory) -> None:
        """The node as the inventory reads it: the driver version decides "auto" (and r550+ for
        checkpointing at all); on --sim the simulated program is told the GPUs and their models,
        which the real program learns from the driver, so it can refuse a map across models."""
        self.driver_version = inventory.driver_version or None
        self.amd = any(g.vendor == "amd" for g in inventory.gpus)
        if self.sim_dir is None or self.amd:
            return
        gpus = {g.uuid: g.model for g in inventory.gpus}
        if gpus != self._gpus_written:
            try:
                write_gpus(self.sim_dir, gpus)
                self._gpus_written = gpus
            except OSError as exc:
                log.warning("cannot tell the simulated cuda-checkpoint the GPUs: %s", exc)

    def resume_devices(self, job_id: int, inventory: Inventory) -> tuple[str, ...]:
        """Where a checkpointed job may resume: its own GPUs, or with moves any whole GPU (MIG off)
        of the models it was on (the scheduler's own choice after a preemption, core/sched_preempt)."""
        entry = self.saved.get(job_id)
        if entry is None:
            return ()
        if not self.moves:
            return entry.uuids
        models = {g.model for g in inventory.gpus if g.uuid in entry.uuids}
        moved = tuple(g.uuid for g in inventory.gpus if g.model in models and not g.mig_enabled)
        return tuple(dict.fromkeys((*entry.uuids, *moved)))

    def device_map(self, job_id: int, new: Sequence[str]) -> dict[str, str] | None:
        """`--device-map` for restoring on `new`: the job's old GPUs paired with the new ones in order
        (the job's device i stays its device i); None when it resumes where it was."""
        entry = self.saved.get(job_id)
        if entry is None or tuple(new) == entry.uuids:
            return None
        if len(new) != len(entry.uuids):
            raise CheckpointError(0, f"job {job_id} was checkpointed on {len(entry.uuids)} GPU(s) and given "
                                  f"{len(new)}; a device map pairs them one to one")
        return dict(zip(entry.uuids, new, strict=True))

    def launch_env(self, job_id: int) -> dict[str, str]:
        """The environment the job was launched with: a restored job still runs with it."""
        entry = self.saved.get(job_id)
        return dict(entry.env) if entry is not None else {}

    def restoring_to(self, job_id: int, uuids: Sequence[str]) -> None:
        """Record where a restore is going before it runs (a restart mid-restore finishes it there)."""
        entry = self.saved.get(job_id)
        if entry is not None and entry.to != tuple(uuids):
            self.saved[job_id] = Saved(entry.uuids, entry.pids, entry.env, tuple(uuids))
            self._save()

    def holds(self, job: Job) -> bool:
        """Is this job checkpointed (SUSPENDED, its GPU given away, waiting to be restored)?"""
        return job.id in self.saved and job.state is JobState.SUSPENDED and job.allocation is None

    def why_not(self, job: Job) -> str | None:
        """Why this job cannot be checkpointed now, or None when it can."""
        if self.tool is None:
            return "checkpointing is off"
        if self.amd:
            return "cuda-checkpoint is NVIDIA only; this node's GPUs are AMD"
        if job.state is not JobState.RUNNING or not job.pid:
            return f"job is {job.state}, not RUNNING"
        return unsupported_reason(job.allocation, machine=self.machine, driver_version=self.driver_version)

    async def checkpoint(self, job: Job, pids: list[int]) -> None:
        """Checkpoint the job's CUDA processes (`cuda-checkpoint` works on one process at a time).
        Raises CheckpointError; the processes checkpointed before the failure are restored, so the
        job runs on as it was (as far as the program can roll back; the error's `state` says)."""
        assert self.tool is not None and job.allocation is not None
        done: list[int] = []
        try:
            for pid in pids:
                try:
                    await self.tool.checkpoint(pid)
                except CheckpointError:
                    if _gone(pid):  # it exited since it was listed: no GPU state to keep
                        continue
                    raise
                done.append(pid)
        except CheckpointError:
            for pid in done:
                with contextlib.suppress(CheckpointError):
                    await self.tool.restore(pid)
            raise
        self.saved[job.id] = Saved(tuple(job.allocation.uuids), tuple(done), dict(job.allocation.env))
        self._save()

    async def restore(self, job: Job, device_map: Mapping[str, str] | None = None) -> None:
        """Restore the job's CUDA processes onto its GPUs, or through `device_map` onto others.
        Raises CheckpointError."""
        if self.tool is None:
            raise CheckpointError(job.pid or 0, "checkpointing is off (the daemon restarted with checkpoint = "
                                  "false or without cuda-checkpoint); the job cannot get its GPU state back")
        entry = self.saved.get(job.id)
        restored = 0
        for pid in (entry.pids if entry is not None else ()) or ((job.pid,) if job.pid else ()):
            try:
                await self.tool.restore(pid, device_map)
            except CheckpointError as exc:
                if _gone(pid) and pid != job.pid:  # a worker that exited while checkpointed needs nothing
                    continue
                if device_map and restored == 0 and exc.state == "checkpointed":
                    raise MoveRefused(exc) from exc
                raise
            restored += 1

    def stay(self, job_id: int) -> tuple[str, ...]:
        """After a refused move: the job waits for its own GPUs (where its state can go back without
        a map); the restore target is cleared. Returns those GPUs."""
        entry = self.saved.get(job_id)
        if entry is None:
            return ()
        if entry.to:
            self.saved[job_id] = Saved(entry.uuids, entry.pids, entry.env)
            self._save()
        return entry.uuids

    def forget(self, job_id: int) -> None:
        if self.saved.pop(job_id, None) is not None:
            self._save()

    def begin(self, job_id: int, pids: list[int]) -> None:
        """Before the first cuda-checkpoint call: a crash from here until `end` may leave these
        processes locked or checkpointed with the job recorded RUNNING; the next start gives them
        their GPU state back (Engine._repair_checkpoints)."""
        self.underway[job_id] = list(pids)
        self.store.set_meta(UNDERWAY_KEY, json.dumps({str(j): p for j, p in self.underway.items()}))

    def end(self, job_id: int) -> None:
        """The checkpoint is recorded (the job SUSPENDED) or rolled back."""
        if self.underway.pop(job_id, None) is not None:
            self.store.set_meta(UNDERWAY_KEY, json.dumps({str(j): p for j, p in self.underway.items()}))

    def _save(self) -> None:
        data: dict[str, dict[str, object]] = {}
        for job_id, entry in self.saved.items():
            row: dict[str, object] = {"uuids": list(entry.uuids), "pids": list(entry.pids)}
            if entry.env:
                row["env"] = dict(entry.env)
            if entry.to:
                row["to"] = list(entry.to)
            data[str(job_id)] = row
        self.store.set_meta(META_KEY, json.dumps(data))


def _strings(value: object) -> tuple[str, ...] | None:
    """A JSON list of strings as a tuple; None when it is anything else."""
    if isinstance(value, list) and all(isinstance(u, str) for u in value):
        return tuple(value)
    return None


def _load(saved: str | None) -> dict[int, Saved]:
    """The saved map; entries that are not `job id -> {uuids: [...], pids: [...], env?: {...}, to?: [...]}`
    are dropped (an older record without env or to is read as having none)."""
    if not saved:
        return {}
    try:
        data = json.loads(saved)
    except ValueError:
        log.warning("the saved list of checkpointed jobs is unreadable; none is restored")
        return {}
    out: dict[int, Saved] = {}
    if isinstance(data, Mapping):
        for key, entry in data.items():
            if not (isinstance(key, str) and key.isdigit() and isinstance(entry, Mapping)):
                continue
            uuids, to = _strings(entry.get("uuids")), _strings(entry.get("to", []))
            pids, env = entry.get("pids", []), entry.get("env", {})
            if uuids and to is not None \
                    and isinstance(pids, list) and all(isinstance(p, int) and p > 0 for p in pids) \
                    and isinstance(env, Mapping) and all(isinstance(v, str) for v in env.values()):
                out[int(key)] = Saved(uuids, tuple(pids), dict(env), to)
    return out


def _load_underway(saved: str | None) -> dict[int, list[int]]:
    """The checkpoints under way when the last daemon stopped; malformed entries are dropped."""
    try:
        data = json.loads(saved) if saved else {}
    except ValueError:
        return {}
    if not isinstance(data, Mapping):
        return {}
    return {int(k): [p for p in v if isinstance(p, int) and not isinstance(p, bool) and p > 0]
            for k, v in data.items() if isinstance(k, str) and k.isdigit() and isinstance(v, list)}


def _gone(pid: int) -> bool:
    """The process no longer exists (or is a zombie): cuda-checkpoint has nothing of it to save or restore."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rindex(b")") + 2 :][:1] in (b"Z", b"X")
