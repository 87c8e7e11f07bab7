"""A user's suspend or resume that lands while the daemon checkpoints or restores the job (audit of
work-preserving preemption: both left a job RUNNING in the store with its CUDA state checkpointed,
holding its GPU with every CUDA call blocked for ever). Each test fails on the code before."""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import pytest

from gpusched.daemon.checkpointing import Checkpoints
from gpusched.gpu.simcheckpoint import inject
from gpusched.model import JobState
from gpusched.protocol import CancelRequest, CancelResult, ShowRequest, ShowResult
from tests.conftest import wait_until
from tests.integration.test_checkpoint import _counting, _submit, needs_root
from tests.integration.test_daemon import state_of
from tests.integration.test_identity import as_user


def _cuda_state(daemon: Any, pid: int) -> str:
    return asyncio.run(daemon.daemon.engine.checkpoints.tool.state(pid))


def _moves_done(daemon: Any) -> None:
    wait_until(lambda: daemon.call_in_loop(lambda: not daemon.daemon.engine._gpu_state_moves),
               what="the checkpoint or restore task to finish")


@needs_root
def test_a_suspend_is_refused_while_the_job_is_being_checkpointed(daemon_factory: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    checkpointed, release = threading.Event(), threading.Event()
    real = Checkpoints.checkpoint

    async def held(self: Checkpoints, job: Any, pids: list[int]) -> None:
        await real(self, job, pids)  # its processes are checkpointed; the daemon has not recorded it yet
        checkpointed.set()
        await asyncio.to_thread(release.wait, 30)

    monkeypatch.setattr(Checkpoints, "checkpoint", held)
    daemon = daemon_factory(sim="H100-80GB:1")
    with daemon.client() as c:
        trainer, pid = _counting(c, daemon.socket, at_least=2)
        interactive = _submit(20011, daemon.socket, ["sleep", "60"], job_class="interactive")
        assert checkpointed.wait(30)
        [reply] = as_user(20010, daemon.socket, {"op": "suspend", "job_ids": [trainer]})
        release.set()
        assert reply["ok"] and reply["result"]["changed"] == [], reply
        assert "being checkpointed" in str(reply["result"]), reply
        _moves_done(daemon)
        job = c.call(ShowRequest(job_id=trainer), ShowResult).job
        # checkpointed as the scheduler wanted: its GPU went to the interactive job
        assert job.state is JobState.SUSPENDED and job.allocation is None
        assert _cuda_state(daemon, pid) == "checkpointed"
        wait_until(lambda: state_of(c, interactive) is JobState.RUNNING, what="the interactive job running")
        c.call(CancelRequest(job_ids=[trainer, interactive]), CancelResult)


@needs_root
def test_a_resume_is_refused_while_the_job_is_restored_and_a_failed_restore_ends_it(
        daemon_factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    restoring, release = threading.Event(), threading.Event()
    real = Checkpoints.restore

    async def held(self: Checkpoints, job: Any, device_map: Any = None) -> None:
        restoring.set()
        await asyncio.to_thread(release.wait, 30)
        await real(self, job, device_map)

    monkeypatch.setattr(Checkpoints, "restore", held)
    daemon = daemon_factory(sim="H100-80GB:1")
    with daemon.client() as c:
        trainer, pid = _counting(c, daemon.socket, at_least=2)
        inject(os.path.join(daemon.state_dir, "sim-checkpoint"), pid, "restore", "CUDA_ERROR_OUT_OF_MEMORY")
        _submit(20011, daemon.socket, ["sleep", "1"], job_class="interactive")
        assert restoring.wait(60), "no restore started"
        [reply] = as_user(20010, daemon.socket, {"op": "resume", "job_ids": [trainer]})
        release.set()
        assert reply["ok"] and reply["result"]["changed"] == [], reply
        assert "being restored" in str(reply["result"]), reply
        _moves_done(daemon)
        wait_until(lambda: state_of(c, trainer) is JobState.FAILED, timeout=15, what="the job whose restore failed")
        job = c.call(ShowRequest(job_id=trainer), ShowResult).job
        assert job.reason.startswith("restore from checkpoint failed"), job.reason



WORKER = "sh -c 'i=0; while true; do i=$((i+1)); echo $i; sleep 0.05; done' & wait"


@needs_root
def test_a_checkpointed_job_with_a_worker_child_makes_no_progress(daemon_factory: Any) -> None:
    """docs/gpu.md: a checkpointed job makes no progress at all (simulated GPUs). Only the job's
    leader was checkpointed on `--sim` (NVML lists no job processes there), so a worker child, the
    one that would hold the CUDA context, ran on with its GPU given away (audit)."""
    from gpusched.daemon.procfs import session_members, session_states
    from tests.integration.test_checkpoint import _counts

    daemon = daemon_factory(sim="H100-80GB:1")
    with daemon.client() as c:
        trainer = _submit(20010, daemon.socket, ["sh", "-c", WORKER])
        wait_until(lambda: len(_counts(c, trainer)) >= 2, what="counting")
        pid = c.call(ShowRequest(job_id=trainer), ShowResult).job.pid
        assert pid is not None and len(session_members(pid)) >= 2  # the leader and its worker
        interactive = _submit(20011, daemon.socket, ["sleep", "30"], job_class="interactive")
        wait_until(lambda: state_of(c, interactive) is JobState.RUNNING, timeout=30, what="interactive running")
        job = c.call(ShowRequest(job_id=trainer), ShowResult).job
        assert job.state is JobState.SUSPENDED and job.allocation is None, (job.state, job.reason)
        # every process of the job stopped, the worker too (a `sleep` that ended waits as a zombie)
        assert session_states([pid])[pid] <= {"T", "Z"}
        c.call(CancelRequest(job_ids=[interactive]), CancelResult)
        wait_until(lambda: state_of(c, trainer) is JobState.RUNNING, timeout=30, what="the trainer restored")
        wait_until(lambda: "T" not in session_states([pid])[pid], what="every process of the job continued")
        c.call(CancelRequest(job_ids=[trainer]), CancelResult)
