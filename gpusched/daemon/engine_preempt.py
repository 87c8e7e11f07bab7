"""Preemption that loses no work, carried out: a share suspended in place (SIGSTOP), a whole-GPU
job checkpointed with cuda-checkpoint and restored on its GPU, or moved to another of the same model
with a device map (daemon/checkpointing.py).

Requeue preemption needs nothing here: it is a stop request (engine_core)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Iterable

from gpusched.daemon.checkpointing import MoveRefused
from gpusched.daemon.engine_core import EngineCore
from gpusched.daemon.launch import cuda_pids
from gpusched.daemon.recovery import StopRequest
from gpusched.gpu.checkpoint import CheckpointError
from gpusched.model import (
    TERMINAL_STATES,
    Event,
    Job,
    JobState,
)
from gpusched.policy import Pins

log = logging.getLogger("gpusched.engine")


class PreemptionMixin(EngineCore):
    """Suspend-in-place, checkpoint and restore."""

    def _yield(self, job: Job, reason: str) -> None:
        """Preempt a share by suspending it in place (SIGSTOP): it keeps its GPU memory and MPS slot,
        gives up its compute, and continues on a ResumeJob. Nothing is lost."""
        if job.state is not JobState.RUNNING or not job.pid or job.id in self._stops:
            self._preempt_failed(job.id)
            return
        self._set_yielded(job.id, True)
        self.executor.signal(job.pid, signal.SIGSTOP)
        self._set(job, JobState.SUSPENDED, reason)

    def _preempt_failed(self, job_id: int) -> None:
        """Tell the policy its PreemptJob was not carried out (one without `Pins` decides afresh next pass)."""
        if isinstance(self.scheduler, Pins):
            self.scheduler.preempt_failed(job_id)

    def _requeue_pinned(self, job: Job, devices: Iterable[str]) -> None:
        """A checkpointed job waits again, for the devices that hold its state: pinned there when the
        policy can pin, and handed to its queue when it keeps one (else the snapshot shows it)."""
        if isinstance(self.scheduler, Pins):
            self.scheduler.pin(job.id, devices)
        if (queue := self._queue) is not None:
            queue.submit(job)

    async def _checkpoint(self, job: Job, reason: str) -> None:
        """Preempt by checkpoint (daemon/checkpointing.py): the job keeps its processes and its work,
        gives up its GPU, and waits pinned to it. Any failure leaves it running where it was."""
        why_not = self.checkpoints.why_not(job)
        if why_not is None and job.id in self._stops:
            why_not = "job is being stopped"
        if why_not is None:
            try:
                pids = await asyncio.to_thread(cuda_pids, self.backend, job)
                self.checkpoints.begin(job.id, pids)  # a crash from here on is repaired at the next start
                await self.checkpoints.checkpoint(job, pids)
            except CheckpointError as exc:
                why_not = f"{exc.message} (its CUDA state: {exc.state or 'unknown'})"
        current = self.jobs.get(job.id)
        if why_not is None and (current is None or current.state is not JobState.RUNNING):
            why_not = "it changed state while being checkpointed"
            if current is not None and current.state not in TERMINAL_STATES:
                # Alive, and kept where it was (stopped by a SIGSTOP from outside, say): it must get
                # its GPU state back, or it would hold its GPU with every CUDA call blocked for ever.
                await self._give_back_gpu_state(job.id, pids)
            self.checkpoints.forget(job.id)  # (a job that ended: its end releases the GPU)
        if why_not is not None or current is None:
            self.checkpoints.end(job.id)
            log.warning("job %d: not preempted by checkpoint: %s", job.id, why_not)
            self.store.add_event(Event(at=self.clock(), kind="checkpoint_failed", job_id=job.id,
                                       message=f"not checkpointed, runs on: {why_not}"))
            self._preempt_failed(job.id)
            self.wake()
            return
        current = self._set(current, JobState.SUSPENDED, reason, allocation=None)
        self.checkpoints.end(job.id)
        self._requeue_pinned(current, self.checkpoints.resume_devices(current.id, self.inventory))
        self.store.add_event(Event(at=self.clock(), kind="checkpoint", job_id=job.id,
                                   message=f"checkpointed; its GPU state waits in host memory: {reason}"))
        self.wake()

    async def _give_back_gpu_state(self, job_id: int, pids: list[int]) -> None:
        """Restore the processes of a checkpoint that is not kept (each as far as it goes)."""
        tool = self.checkpoints.tool
        if tool is None:
            return
        for pid in pids:
            try:
                await tool.restore(pid)
            except CheckpointError as exc:
                if os.path.exists(f"/proc/{pid}"):
                    log.warning("job %d: pid %d could not be given its GPU state back: %s", job_id, pid, exc.message)

    async def _repair_checkpoints(self) -> None:
        """At start: a checkpoint the last daemon began and never recorded (it crashed in between)
        left the job RUNNING in the store with its processes locked or checkpointed. Give them their
        GPU state back on the GPU they still hold; a job recorded SUSPENDED in time needs nothing."""
        for job_id, pids in sorted(self.checkpoints.underway.items()):
            job = self.jobs.get(job_id)
            if job is not None and job.state is JobState.RUNNING:
                self.checkpoints.forget(job_id)  # a record written just before the crash: it runs where it was
                how = "its processes were given their GPU state back"
                if self.checkpoints.tool is None:
                    how = "checkpointing is off now: its processes may stay frozen (cuda-checkpoint is needed)"
                else:
                    for pid in pids:
                        try:
                            await self.checkpoints.tool.restore(pid)
                        except CheckpointError as exc:
                            if os.path.exists(f"/proc/{pid}"):  # a process that is gone needs nothing
                                how = f"pid {pid} could not be restored: {exc.message}"
                log.warning("job %d: a checkpoint was cut off by the last daemon's end; %s", job_id, how)
                self.store.add_event(Event(at=self.clock(), kind="checkpoint_repaired", job_id=job_id,
                                           message=f"a checkpoint cut off by the daemon's end: {how}"))
            self.checkpoints.end(job_id)

    async def _restore(self, job: Job) -> None:
        """Give a checkpointed job its GPU state back on the devices it was given: the ones that held
        it, or others of the same model through a device map (the job's device i onto its new device
        i). A move that fails while leaving the job checkpointed sends it back to wait for its own
        GPUs (one more chance, without a map); any other failed restore ends the job as it always
        has: requeued or FAILED."""
        new = job.allocation.uuids if job.allocation is not None else []
        still_checkpointed = False
        try:
            device_map = self.checkpoints.device_map(job.id, new)
            await self.checkpoints.restore(job, device_map)
        except MoveRefused as exc:
            still_checkpointed = self._stay_checkpointed(job, exc)
            return
        except CheckpointError as exc:
            current = self.jobs.get(job.id)
            if current is not None and current.state not in TERMINAL_STATES:  # whatever it became meanwhile
                final = JobState.PREEMPTED if current.spec.requeue else JobState.FAILED
                self._request_stop(current, StopRequest(final, f"restore from checkpoint failed: {exc.message}"))
            return
        finally:
            if not still_checkpointed:
                self.checkpoints.forget(job.id)
        current = self.jobs.get(job.id)
        if current is not None and current.state is JobState.SUSPENDED and current.id not in self._stops:
            if device_map:
                how = (f"restored from checkpoint on other GPUs of the same model: "
                       f"{', '.join(f'{a} -> {b}' for a, b in device_map.items())}")
            else:
                how = "restored from checkpoint on the devices that held its state"
            self._set(current, JobState.RUNNING, how)
            self.store.add_event(Event(at=self.clock(), kind="restored", job_id=job.id, message=how,
                                       device=",".join(new) or None, gpu=self._gpu_index(new[0]) if new else None))
            if device_map:
                log.info("job %d: %s", job.id, how)
        self.wake()

    def _stay_checkpointed(self, job: Job, exc: MoveRefused) -> bool:
        """The restore through a device map failed and nothing was restored: give the new GPUs back and wait, still
        checkpointed, for the GPUs that hold the job's state. False when the job is going anyway
        (cancelled meanwhile), so its checkpoint is forgotten as after any restore."""
        current = self.jobs.get(job.id)
        if current is None or current.state is not JobState.SUSPENDED or current.id in self._stops:
            return False
        own = self.checkpoints.stay(job.id)
        why = (f"the restore onto other GPUs failed ({exc.message}); still checkpointed, it waits for "
               "the GPUs that hold its state")
        log.warning("job %d: %s", job.id, why)
        # Still SUSPENDED throughout (no transition): only the GPUs it was given and the reason change.
        current = self.jobs[current.id] = self.store.update(current, allocation=None, reason=why)
        self.store.add_event(Event(at=self.clock(), kind="restore_move_failed", job_id=job.id, message=why))
        self._requeue_pinned(current, own)
        self.wake()
        return True

    def _gpu_index(self, uuid: str) -> int | None:
        return next((g.index for g in self.inventory.gpus if g.uuid == uuid), None)
