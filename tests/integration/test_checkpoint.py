"""Preemption by checkpoint in the live daemon: the victim keeps its process and its work, gives its
GPU to the job that preempted it, and is restored on the same GPU afterwards (issue 11).

The simulated cuda-checkpoint (gpu/simcheckpoint.py) stands in for NVIDIA's; it stops a locked or
checkpointed process with SIGSTOP, so "no progress while checkpointed" is observable in /proc.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from gpusched.config import GpuConfig
from gpusched.daemon.checkpointing import META_KEY
from gpusched.daemon.store import StoreReader
from gpusched.gpu.simcheckpoint import inject
from gpusched.model import Event, JobSpec, JobState, ShareRequest, WholeRequest
from gpusched.protocol import CancelRequest, CancelResult, LogsRequest, LogsResult, ShowRequest, ShowResult
from gpusched_cli.client import Client
from tests.conftest import wait_until
from tests.integration.test_daemon import state_of
from tests.integration.test_identity import as_user

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as two users")

COUNTER = "i=0; while true; do i=$((i+1)); echo $i; sleep 0.05; done"


def _submit(uid: int, socket: str, argv: list[str], request: Any = None, **fields: Any) -> int:
    spec = JobSpec(argv=argv, cwd="/tmp", env={"PATH": "/usr/bin:/bin"}, request=request or WholeRequest(gpus=1),
                   **fields)
    [reply] = as_user(uid, socket, {"op": "submit", "spec": spec.model_dump(mode="json")})
    assert reply["ok"], reply
    return int(reply["result"]["job_id"])


def _counts(c: Client, job_id: int) -> list[int]:
    return [int(line) for line in c.call(LogsRequest(job_id=job_id), LogsResult).data.split()]


def _events(state_dir: str, job_id: int) -> list[Event]:
    reader = StoreReader.open(os.path.join(state_dir, "gpusched.db"))
    try:
        return reader.events(job_id=job_id)
    finally:
        reader.close()


def _counting(c: Client, socket: str, request: Any = None, at_least: int = 1, **fields: Any) -> tuple[int, int]:
    """A trainer's job (uid 20010) that prints 1, 2, 3, ...: (its id, its pid) once it has counted."""
    job_id = _submit(20010, socket, ["sh", "-c", COUNTER], request=request, **fields)
    wait_until(lambda: len(_counts(c, job_id)) >= at_least, what="the trainer counting")
    pid = c.call(ShowRequest(job_id=job_id), ShowResult).job.pid
    assert pid
    return job_id, pid


def _counts_on_without_redoing(c: Client, job_id: int) -> None:
    """It counts again, and its output is 1..n with nothing repeated: one process did all the work."""
    frozen = len(_counts(c, job_id))
    wait_until(lambda: len(_counts(c, job_id)) > frozen + 3, what="the job counting again")
    counts = _counts(c, job_id)
    assert counts == list(range(1, len(counts) + 1))


def _proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@needs_root
def test_a_checkpointed_job_gives_its_gpu_away_and_resumes_where_it_was(daemon_factory: Any) -> None:
    daemon = daemon_factory(sim="H100-80GB:1")
    with daemon.client() as c:
        trainer, _ = _counting(c, daemon.socket, at_least=3)
        before = c.call(ShowRequest(job_id=trainer), ShowResult).job
        assert before.allocation is not None and before.pid
        gpu = before.allocation.uuids

        interactive = _submit(20011, daemon.socket, ["sh", "-c", "echo $CUDA_VISIBLE_DEVICES; sleep 1"],
                              job_class="interactive")
        wait_until(lambda: state_of(c, interactive) is JobState.RUNNING, timeout=30, what="interactive job running")
        held = c.call(ShowRequest(job_id=trainer), ShowResult).job
        assert held.state is JobState.SUSPENDED and held.allocation is None, (held.state, held.reason)
        assert "checkpointed" in held.reason and "interactive" in held.reason
        assert held.pid == before.pid and _proc_state(held.pid) == "T"  # alive, making no progress
        reader = StoreReader.open(os.path.join(daemon.state_dir, "gpusched.db"))
        try:  # what a restart needs to restore it: which job, on which GPU
            assert json.loads(reader.get_meta(META_KEY) or "{}") == {str(trainer): {"uuids": gpu, "pids": [before.pid]}}
        finally:
            reader.close()
        assert c.call(ShowRequest(job_id=interactive), ShowResult).job.allocation.uuids == gpu  # type: ignore[union-attr]

        wait_until(lambda: state_of(c, interactive) is JobState.COMPLETED, timeout=30, what="interactive job done")
        wait_until(lambda: state_of(c, trainer) is JobState.RUNNING, timeout=30, what="trainer restored")
        after = c.call(ShowRequest(job_id=trainer), ShowResult).job
        assert after.pid == before.pid and after.allocation is not None and after.allocation.uuids == gpu
        assert after.reason.startswith("restored from checkpoint")
        _counts_on_without_redoing(c, trainer)
        assert [t.state for t in after.history] == [JobState.PENDING, JobState.STARTING, JobState.RUNNING,
                                                    JobState.SUSPENDED, JobState.RUNNING]
        c.call(CancelRequest(job_ids=[trainer]), CancelResult)
        wait_until(lambda: state_of(c, trainer) is JobState.CANCELLED, what="trainer cancelled")


@needs_root
def test_a_checkpointed_job_survives_a_daemon_restart_and_is_restored_after_it(daemon_factory: Any) -> None:
    daemon = daemon_factory(sim="H100-80GB:1")
    with daemon.client() as c:
        trainer, pid = _counting(c, daemon.socket, at_least=3)
        interactive = _submit(20011, daemon.socket, ["sleep", "2"], job_class="interactive")
        wait_until(lambda: state_of(c, interactive) is JobState.RUNNING, timeout=30, what="interactive job running")
        assert state_of(c, trainer) is JobState.SUSPENDED
    daemon.restart()
    with daemon.client() as c:
        held = c.call(ShowRequest(job_id=trainer), ShowResult).job
        assert held.state is JobState.SUSPENDED and held.allocation is None and held.pid == pid
        wait_until(lambda: state_of(c, interactive) is JobState.COMPLETED, timeout=30, what="interactive job done")
        wait_until(lambda: state_of(c, trainer) is JobState.RUNNING, timeout=30, what="trainer restored")
        assert c.call(ShowRequest(job_id=trainer), ShowResult).job.pid == pid
        _counts_on_without_redoing(c, trainer)
        c.call(CancelRequest(job_ids=[trainer]), CancelResult)
        wait_until(lambda: state_of(c, trainer) is JobState.CANCELLED, what="trainer cancelled")


@needs_root
def test_cancelling_a_checkpointed_job_ends_it_and_frees_nothing_twice(daemon_factory: Any) -> None:
    daemon = daemon_factory(sim="H100-80GB:1")
    with daemon.client() as c:
        trainer, pid = _counting(c, daemon.socket)
        interactive = _submit(20011, daemon.socket, ["sleep", "30"], job_class="interactive")
        wait_until(lambda: state_of(c, interactive) is JobState.RUNNING, timeout=30, what="interactive job running")
        assert state_of(c, trainer) is JobState.SUSPENDED
        c.call(CancelRequest(job_ids=[trainer]), CancelResult)
        wait_until(lambda: state_of(c, trainer) is JobState.CANCELLED, timeout=30, what="checkpointed job cancelled")
        wait_until(lambda: not os.path.exists(f"/proc/{pid}"), what="its process gone")
        assert state_of(c, interactive) is JobState.RUNNING  # its GPU was never given back to the trainer
        c.call(CancelRequest(job_ids=[interactive]), CancelResult)


@needs_root
def test_a_failed_checkpoint_leaves_the_job_running_and_falls_back(daemon_factory: Any) -> None:
    """The program fails (injected CUDA error): the victim runs on untouched; the interactive job
    waits, since the victim is not --requeue and may not be checkpointed again."""
    daemon = daemon_factory(sim="H100-80GB:1")
    with daemon.client() as c:
        trainer, pid = _counting(c, daemon.socket)
        inject(os.path.join(daemon.state_dir, "sim-checkpoint"), pid, "checkpoint", "CUDA_ERROR_OUT_OF_MEMORY")
        interactive = _submit(20011, daemon.socket, ["true"], job_class="interactive")
        wait_until(lambda: any(e.kind == "checkpoint_failed" and "out of memory" in e.message
                               for e in _events(daemon.state_dir, trainer)), timeout=30, what="the failure recorded")
        seen = len(_counts(c, trainer))
        wait_until(lambda: len(_counts(c, trainer)) > seen + 3, what="the trainer still counting")
        assert state_of(c, trainer) is JobState.RUNNING and _proc_state(pid) != "T"
        assert state_of(c, interactive) is JobState.PENDING
        c.call(CancelRequest(job_ids=[trainer, interactive]), CancelResult)


@needs_root
def test_a_restore_that_fails_ends_the_job_with_the_reason(daemon_factory: Any) -> None:
    """NVIDIA/cuda-checkpoint#44: a restore out of memory leaves the process checkpointed for good;
    the job cannot run again, so it ends FAILED (a --requeue job would start over) and frees its GPU."""
    daemon = daemon_factory(sim="H100-80GB:1")
    with daemon.client() as c:
        trainer, pid = _counting(c, daemon.socket)
        inject(os.path.join(daemon.state_dir, "sim-checkpoint"), pid, "restore", "CUDA_ERROR_OUT_OF_MEMORY")
        interactive = _submit(20011, daemon.socket, ["sleep", "1"], job_class="interactive")
        wait_until(lambda: state_of(c, trainer) is JobState.FAILED, timeout=30, what="trainer failed")
        job = c.call(ShowRequest(job_id=trainer), ShowResult).job
        assert "restore from checkpoint failed" in job.reason and "out of memory" in job.reason, job.reason
        assert state_of(c, interactive) is JobState.COMPLETED
        wait_until(lambda: not os.path.exists(f"/proc/{pid}"), what="its process gone")


@needs_root
def test_a_share_is_suspended_in_place_for_an_interactive_share_and_continues_after_it(daemon_factory: Any) -> None:
    """SIGSTOP in place on a share device: the batch share keeps its GPU memory and MPS slot, gives
    its compute to the interactive share, and continues (same process) once that one has ended."""
    daemon = daemon_factory(sim="H100-80GB:1", gpus={"0": GpuConfig(share="mps")})
    half = ShareRequest(fraction=0.5, gpu_mem_mib=10240)
    with daemon.client() as c:
        pids = dict(_counting(c, daemon.socket, request=half, at_least=2) for _ in range(2))
        batch = list(pids)
        interactive = _submit(20011, daemon.socket, ["sleep", "1"], request=half, job_class="interactive")
        wait_until(lambda: state_of(c, interactive) is JobState.RUNNING, timeout=30, what="interactive share running")
        [stopped] = [j for j in batch if state_of(c, j) is JobState.SUSPENDED]
        job = c.call(ShowRequest(job_id=stopped), ShowResult).job
        assert "suspended in place" in job.reason and job.allocation is not None  # it keeps its memory
        assert _proc_state(pids[stopped]) == "T"
        wait_until(lambda: state_of(c, interactive) is JobState.COMPLETED, timeout=30, what="interactive done")
        wait_until(lambda: state_of(c, stopped) is JobState.RUNNING, timeout=30, what="batch share continued")
        job = c.call(ShowRequest(job_id=stopped), ShowResult).job
        assert job.pid == pids[stopped] and "continues where it stopped" in job.reason
        _counts_on_without_redoing(c, stopped)
        c.call(CancelRequest(job_ids=batch), CancelResult)


@needs_root
def test_a_requeue_job_whose_restore_fails_starts_over(daemon_factory: Any) -> None:
    """The same failed restore for a --requeue job: it is preempted for good and queued again, and
    starts from scratch (a new process) once the GPU is free."""
    daemon = daemon_factory(sim="H100-80GB:1")
    with daemon.client() as c:
        trainer, pid = _counting(c, daemon.socket, requeue=True)
        inject(os.path.join(daemon.state_dir, "sim-checkpoint"), pid, "restore", "CUDA_ERROR_OUT_OF_MEMORY")
        interactive = _submit(20011, daemon.socket, ["sleep", "1"], job_class="interactive")
        wait_until(lambda: state_of(c, interactive) is JobState.COMPLETED, timeout=30, what="interactive job done")
        wait_until(lambda: (j := c.call(ShowRequest(job_id=trainer), ShowResult).job).state is JobState.RUNNING
                   and j.pid != pid, timeout=30, what="trainer started over")
        states = [t.state for t in c.call(ShowRequest(job_id=trainer), ShowResult).job.history]
        assert JobState.PREEMPTED in states and states[-1] is JobState.RUNNING
        wait_until(lambda: not os.path.exists(f"/proc/{pid}"), what="its first process gone")
        c.call(CancelRequest(job_ids=[trainer]), CancelResult)
