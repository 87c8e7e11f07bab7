"""Preemption that loses no work: checkpoint a whole-GPU job's CUDA state, give its GPU away, restore it.

When the scheduler preempts a whole-GPU job in `checkpoint` mode (core/preempt.py), the engine asks
`cuda-checkpoint` (gpu/checkpoint.py; the simulated program on `--sim`) to move the job's GPU memory
to host memory and release the GPU. The job's processes live on, SUSPENDED with no allocation: its
devices are free for the job that preempted it. The job waits in the scheduler's queue pinned to the
GPUs that hold its state (`Scheduler.pin`), and when the scheduler starts it again the engine restores
it there instead of launching anything: same process, same progress.

This module keeps what must survive a daemon restart (which jobs are checkpointed, and on which GPUs
they resume: store meta `checkpointed`) and runs the program; the engine decides when.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
from collections.abc import Mapping

from gpusched.daemon.store import Store
from gpusched.gpu.checkpoint import CheckpointError, CudaCheckpoint, checkpoint_binary, unsupported_reason
from gpusched.gpu.simcheckpoint import DIR_ENV
from gpusched.model import Job, JobState

META_KEY = "checkpointed"

log = logging.getLogger("gpusched.checkpoint")


class Checkpoints:
    """Which jobs are checkpointed and where they resume; the calls that checkpoint and restore them."""

    def __init__(self, store: Store, tool: CudaCheckpoint | None, *, machine: str | None = None) -> None:
        self.store = store
        self.tool = tool
        self.machine = machine or platform.machine()
        self.driver_version: str | None = None  # from the inventory; None on simulated GPUs
        self.pinned: dict[int, tuple[str, ...]] = {}  # checkpointed job -> the GPUs that hold its state
        self.pids: dict[int, tuple[int, ...]] = {}  # ... and its processes that were checkpointed
        for job_id, (uuids, pids) in _load(store.get_meta(META_KEY)).items():
            self.pinned[job_id] = uuids
            if pids:
                self.pids[job_id] = pids

    @classmethod
    def from_config(cls, store: Store, *, enabled: bool, binary: str | None, timeout_s: float, sim: bool,
                    state_dir: str) -> Checkpoints:
        """The daemon's: off when `enabled` is false or the program cannot be run. On simulated GPUs
        the simulated program keeps its per-process state under the daemon's state dir."""
        if not enabled:
            return cls(store, None)
        program = checkpoint_binary(binary, sim=sim)
        env = None
        if sim and binary is None:
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), DIR_ENV: os.path.join(state_dir, "sim-checkpoint")}
        tool = CudaCheckpoint(program, timeout_s, env=env)
        if not tool.available():
            log.info("cuda-checkpoint (%s) is not available: preemption requeues instead of checkpointing", program)
            return cls(store, None)
        return cls(store, tool)

    @property
    def enabled(self) -> bool:
        return self.tool is not None

    def holds(self, job: Job) -> bool:
        """Is this job checkpointed (SUSPENDED, its GPU given away, waiting to be restored)?"""
        return job.id in self.pinned and job.state is JobState.SUSPENDED and job.allocation is None

    def why_not(self, job: Job) -> str | None:
        """Why this job cannot be checkpointed now, or None when it can."""
        if self.tool is None:
            return "checkpointing is off"
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
                await self.tool.checkpoint(pid)
                done.append(pid)
        except CheckpointError:
            for pid in done:
                with contextlib.suppress(CheckpointError):
                    await self.tool.restore(pid)
            raise
        self.pinned[job.id] = tuple(job.allocation.uuids)
        self.pids[job.id] = tuple(pids)
        self._save()

    async def restore(self, job: Job) -> None:
        """Restore the job's CUDA processes onto its GPUs. Raises CheckpointError."""
        if self.tool is None:
            raise CheckpointError(job.pid or 0, "checkpointing is off (the daemon restarted with checkpoint = "
                                  "false or without cuda-checkpoint); the job cannot get its GPU state back")
        for pid in self.pids.get(job.id) or ((job.pid,) if job.pid else ()):
            await self.tool.restore(pid)

    def forget(self, job_id: int) -> None:
        self.pids.pop(job_id, None)
        if self.pinned.pop(job_id, None) is not None:
            self._save()

    def _save(self) -> None:
        self.store.set_meta(META_KEY, json.dumps(
            {str(k): {"uuids": list(v), "pids": list(self.pids.get(k, ()))} for k, v in self.pinned.items()}))


def _load(saved: str | None) -> dict[int, tuple[tuple[str, ...], tuple[int, ...]]]:
    """The saved map; entries that are not `job id -> {uuids: [...], pids: [...]}` are dropped."""
    if not saved:
        return {}
    try:
        data = json.loads(saved)
    except ValueError:
        log.warning("the saved list of checkpointed jobs is unreadable; none is restored")
        return {}
    out: dict[int, tuple[tuple[str, ...], tuple[int, ...]]] = {}
    if isinstance(data, Mapping):
        for key, entry in data.items():
            if not (isinstance(key, str) and key.isdigit() and isinstance(entry, Mapping)):
                continue
            uuids, pids = entry.get("uuids"), entry.get("pids", [])
            if isinstance(uuids, list) and uuids and all(isinstance(u, str) for u in uuids) \
                    and isinstance(pids, list) and all(isinstance(p, int) and p > 0 for p in pids):
                out[int(key)] = (tuple(uuids), tuple(pids))
    return out
