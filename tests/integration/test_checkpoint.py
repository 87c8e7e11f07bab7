"""Preemption by checkpoint in the live daemon: the victim keeps its process and its work, gives its
GPU to the job that preempted it, and is restored on the same GPU afterwards, or (checkpoint_moves)
on another GPU of its model that frees first, through cuda-checkpoint --device-map (issue 11).

The simulated cuda-checkpoint (gpu/simcheckpoint.py) stands in for NVIDIA's; it stops a locked or
checkpointed process with SIGSTOP, so "no progress while checkpointed" is observable in /proc.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from gpusched.config import GpuConfig, SchedulerSection
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
        assert held.pid == before.pid  # alive, making no progress (a write to disk in flight ends first: D, then T)
        wait_until(lambda: _proc_state(before.pid or 0) == "T", timeout=10, what="the trainer stopped")
        reader = StoreReader.open(os.path.join(daemon.state_dir, "gpusched.db"))
        try:  # what a restart needs to restore it: which job, on which GPU
            assert json.loads(reader.get_meta(META_KEY) or "{}") == {
                str(trainer): {"uuids": gpu, "pids": [before.pid], "env": before.allocation.env}}
        finally:
            reader.close()
        assert c.call(ShowRequest(job_id=interactive), ShowResult).job.allocation.uuids == gpu  # type: ignore[union-attr]

        wait_until(lambda: state_of(c, interactive) is JobState.COMPLETED, timeout=30, what="interactive job done")
        wait_until(lambda: state_of(c, trainer) is JobState.RUNNING, timeout=30, what="trainer restored")
        after = c.call(ShowRequest(job_id=trainer), ShowResult).job
        assert after.pid == before.pid and after.allocation is not None and after.allocation.uuids == gpu
        assert after.reason.startswith("restored from checkpoint")
        assert after.allocation.env == before.allocation.env  # `show` lists what it was launched with
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
def test_a_checkpoint_under_way_when_the_daemon_stops_is_finished_first(daemon_factory: Any,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop (systemctl restart) that lands after cuda-checkpoint froze the job's processes and
    before the job is recorded SUSPENDED waits for the checkpoint to end: cut off there, the job
    stayed RUNNING in the store with its processes checkpointed, frozen for good."""
    import asyncio
    import threading

    from gpusched.daemon.checkpointing import Checkpoints

    checkpointed, release = threading.Event(), threading.Event()
    real = Checkpoints.checkpoint

    async def stopped_midway(self: Checkpoints, job: Any, pids: list[int]) -> None:
        await real(self, job, pids)  # the processes are checkpointed...
        checkpointed.set()
        await asyncio.to_thread(release.wait, 30)  # ...and the daemon is told to stop before the job is SUSPENDED

    monkeypatch.setattr(Checkpoints, "checkpoint", stopped_midway)
    daemon = daemon_factory(sim="H100-80GB:1")
    with daemon.client() as c:
        trainer, pid = _counting(c, daemon.socket, at_least=3)
        interactive = _submit(20011, daemon.socket, ["sleep", "1"], job_class="interactive")
        assert checkpointed.wait(30), "the checkpoint did not start"
    assert daemon.daemon is not None
    engine = daemon.daemon.engine
    stopper = threading.Thread(target=daemon.stop)
    stopper.start()
    wait_until(lambda: engine._loop_task is not None and engine._loop_task.done(), what="the engine stopping")
    release.set()  # only now, with the stop under way
    stopper.join(60)
    monkeypatch.setattr(Checkpoints, "checkpoint", real)
    daemon.restart()
    with daemon.client() as c:
        held = c.call(ShowRequest(job_id=trainer), ShowResult).job
        assert held.state is JobState.SUSPENDED and held.pid == pid, (held.state, held.reason)
        wait_until(lambda: state_of(c, interactive) is JobState.COMPLETED, timeout=30, what="interactive job done")
        wait_until(lambda: state_of(c, trainer) is JobState.RUNNING, timeout=30, what="trainer restored")
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
        # stopped, or about to be: a process in uninterruptible sleep (D, its count's write to disk)
        # takes the SIGSTOP as that write returns
        wait_until(lambda: _proc_state(pids[stopped]) == "T", timeout=10, what="the batch share stopped")
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


def _two_gpus_one_taken_back(daemon: Any, c: Client) -> tuple[int, int, int, int, str, str]:
    """On two GPUs: the trainer counting on one, an interactive job of a third user (never a victim)
    on the other, then another user's interactive job that preempts the trainer by checkpoint.
    Returns (trainer, its pid, the job on the other GPU, the interactive job, the trainer's GPU, the other GPU)."""
    trainer, pid = _counting(c, daemon.socket, at_least=3)
    alloc = c.call(ShowRequest(job_id=trainer), ShowResult).job.allocation
    assert alloc is not None
    [own] = alloc.uuids
    other_job = _submit(20012, daemon.socket, ["sleep", "600"], job_class="interactive")
    wait_until(lambda: state_of(c, other_job) is JobState.RUNNING, timeout=30, what="the other GPU's job running")
    other_alloc = c.call(ShowRequest(job_id=other_job), ShowResult).job.allocation
    assert other_alloc is not None
    [other] = other_alloc.uuids
    interactive = _submit(20011, daemon.socket, ["sleep", "600"], job_class="interactive")
    wait_until(lambda: state_of(c, interactive) is JobState.RUNNING, timeout=30, what="interactive job running")
    held = c.call(ShowRequest(job_id=trainer), ShowResult).job
    assert held.state is JobState.SUSPENDED and held.allocation is None and "checkpointed" in held.reason
    assert c.call(ShowRequest(job_id=interactive), ShowResult).job.allocation.uuids == [own]  # type: ignore[union-attr]
    return trainer, pid, other_job, interactive, own, other


# The interactive job preempts as soon as the trainer's user is above share at all (the default
# margin, 900 GPU-s, is about what three users' estimates leave: too close to rely on).
_PREEMPT_AT_ONCE = SchedulerSection(preempt_lag_margin_gpu_s=0.0)


@needs_root
def test_a_checkpointed_job_resumes_on_another_gpu_of_its_model_that_frees_first(daemon_factory: Any,
                                                                                 tmp_path: Any) -> None:
    """checkpoint_moves = true: its GPU stays taken, the other one frees, and it is restored there
    through --device-map: same process, no work redone, its environment as it was launched; the
    DCGM job mapping follows it to its new GPU."""
    mapping = tmp_path / "dcgm-job-map"
    daemon = daemon_factory(sim="H100-80GB:2", checkpoint_moves=True, scheduler=_PREEMPT_AT_ONCE,
                            job_mapping_dir=str(mapping))
    with daemon.client() as c:
        trainer, pid, other_job, _interactive, own, other = _two_gpus_one_taken_back(daemon, c)
        assert daemon.call_in_loop(lambda: daemon.daemon.engine.snapshot().checkpoint_moves)
        reader = StoreReader.open(os.path.join(daemon.state_dir, "gpusched.db"))
        try:  # it keeps the environment it was launched with, to record it again when restored
            saved = json.loads(reader.get_meta(META_KEY) or "{}")[str(trainer)]
        finally:
            reader.close()
        assert saved["uuids"] == [own] and saved["pids"] == [pid] and saved["env"]["CUDA_VISIBLE_DEVICES"] == own

        c.call(CancelRequest(job_ids=[other_job]), CancelResult)  # the other GPU frees first
        wait_until(lambda: state_of(c, trainer) is JobState.RUNNING, timeout=30, what="trainer restored")
        after = c.call(ShowRequest(job_id=trainer), ShowResult).job
        assert after.pid == pid and after.allocation is not None and after.allocation.uuids == [other]
        assert after.reason == f"restored from checkpoint on other GPUs of the same model: {own} -> {other}"
        assert after.allocation.env["CUDA_VISIBLE_DEVICES"] == own  # unchanged: the driver maps it to {other}
        assert (mapping / str(after.allocation.devices[0].gpu_index)).read_text() == f"{trainer}\n"
        _counts_on_without_redoing(c, trainer)
        [restored] = [e for e in _events(daemon.state_dir, trainer) if e.kind == "restored"]
        assert restored.device == other and f"{own} -> {other}" in restored.message
        with open(os.path.join(daemon.state_dir, "sim-checkpoint", f"{pid}.json")) as f:
            assert json.load(f)["devices"] == [other]  # the program's view: its CUDA state is on {other} now
        reader = StoreReader.open(os.path.join(daemon.state_dir, "gpusched.db"))
        try:
            assert json.loads(reader.get_meta(META_KEY) or "{}") == {}
        finally:
            reader.close()
        c.call(CancelRequest(job_ids=[trainer]), CancelResult)
        wait_until(lambda: state_of(c, trainer) is JobState.CANCELLED, what="trainer cancelled")


@needs_root
def test_without_moves_a_checkpointed_job_waits_for_its_own_gpu(daemon_factory: Any) -> None:
    """checkpoint_moves = false: the other GPU frees and stays free, pass after pass, while the
    trainer waits for the one that holds its state; it is restored there when that one frees."""
    daemon = daemon_factory(sim="H100-80GB:2", checkpoint_moves=False, scheduler=_PREEMPT_AT_ONCE)
    engine = lambda: daemon.daemon.engine  # noqa: E731
    with daemon.client() as c:
        trainer, pid, other_job, interactive, own, _other = _two_gpus_one_taken_back(daemon, c)
        assert not daemon.call_in_loop(lambda: engine().snapshot().checkpoint_moves)
        c.call(CancelRequest(job_ids=[other_job]), CancelResult)
        wait_until(lambda: state_of(c, other_job) is JobState.CANCELLED, timeout=30, what="the other GPU free")
        passes = daemon.call_in_loop(lambda: engine().passes)
        wait_until(lambda: daemon.call_in_loop(lambda: engine().passes) >= passes + 10, timeout=30,
                   what="ten scheduling passes with the other GPU free")
        assert state_of(c, trainer) is JobState.SUSPENDED

        c.call(CancelRequest(job_ids=[interactive]), CancelResult)
        wait_until(lambda: state_of(c, trainer) is JobState.RUNNING, timeout=30, what="trainer restored")
        after = c.call(ShowRequest(job_id=trainer), ShowResult).job
        assert after.pid == pid and after.allocation is not None and after.allocation.uuids == [own]
        assert after.reason == "restored from checkpoint on the devices that held its state"
        _counts_on_without_redoing(c, trainer)
        c.call(CancelRequest(job_ids=[trainer]), CancelResult)
        wait_until(lambda: state_of(c, trainer) is JobState.CANCELLED, what="trainer cancelled")


@needs_root
def test_a_moved_restore_that_fails_waits_checkpointed_for_its_own_gpu(daemon_factory: Any) -> None:
    """The program refuses the map ("invalid argument", as NVIDIA/cuda-checkpoint#35 reports for a
    move the driver would not do) and leaves the process checkpointed: the job gives the GPU it was
    given back, waits for its own, and is restored there without a map, no work redone."""
    daemon = daemon_factory(sim="H100-80GB:2", checkpoint_moves=True, scheduler=_PREEMPT_AT_ONCE)
    with daemon.client() as c:
        trainer, pid, other_job, interactive, own, other = _two_gpus_one_taken_back(daemon, c)
        inject(os.path.join(daemon.state_dir, "sim-checkpoint"), pid, "restore", "CUDA_ERROR_INVALID_VALUE")
        c.call(CancelRequest(job_ids=[other_job]), CancelResult)
        wait_until(lambda: [e for e in _events(daemon.state_dir, trainer) if e.kind == "restore_move_failed"],
                   timeout=30, what="the refused move recorded")
        waiting = c.call(ShowRequest(job_id=trainer), ShowResult).job
        assert waiting.state is JobState.SUSPENDED and waiting.allocation is None, waiting
        assert "invalid argument" in waiting.reason and "waits for the GPUs that hold its state" in waiting.reason
        later = _submit(20012, daemon.socket, ["true"])
        wait_until(lambda: state_of(c, later) is JobState.COMPLETED, timeout=30, what="the GPU it was given reused")
        assert c.call(ShowRequest(job_id=later), ShowResult).job.allocation.uuids == [other]  # type: ignore[union-attr]
        assert state_of(c, trainer) is JobState.SUSPENDED
        c.call(CancelRequest(job_ids=[interactive]), CancelResult)
        wait_until(lambda: state_of(c, trainer) is JobState.RUNNING, timeout=30, what="trainer restored at home")
        after = c.call(ShowRequest(job_id=trainer), ShowResult).job
        assert after.pid == pid and after.allocation is not None and after.allocation.uuids == [own]
        assert "on the devices that held its state" in after.reason, after.reason
        _counts_on_without_redoing(c, trainer)
        c.call(CancelRequest(job_ids=[trainer]), CancelResult)
        wait_until(lambda: state_of(c, trainer) is JobState.CANCELLED, what="trainer cancelled")


@needs_root
def test_after_a_daemon_restart_a_checkpointed_job_may_still_move(daemon_factory: Any) -> None:
    """The pins rebuilt at start-up include the other GPUs of its model, and the restore maps from
    the GPU its state was taken on (kept in meta), not from anything the restart forgot."""
    daemon = daemon_factory(sim="H100-80GB:2", checkpoint_moves=True, scheduler=_PREEMPT_AT_ONCE)
    with daemon.client() as c:
        trainer, pid, other_job, _interactive, own, other = _two_gpus_one_taken_back(daemon, c)
    daemon.restart()
    with daemon.client() as c:
        assert state_of(c, trainer) is JobState.SUSPENDED
        c.call(CancelRequest(job_ids=[other_job]), CancelResult)
        wait_until(lambda: state_of(c, trainer) is JobState.RUNNING, timeout=30, what="trainer restored")
        after = c.call(ShowRequest(job_id=trainer), ShowResult).job
        assert after.pid == pid and after.allocation is not None and after.allocation.uuids == [other]
        assert f"{own} -> {other}" in after.reason
        _counts_on_without_redoing(c, trainer)
        c.call(CancelRequest(job_ids=[trainer]), CancelResult)
        wait_until(lambda: state_of(c, trainer) is JobState.CANCELLED, what="trainer cancelled")


def test_a_checkpoint_cut_off_by_a_crash_is_repaired_at_the_next_start() -> None:
    """What a crash between cuda-checkpoint's first call and the SUSPENDED record leaves: the job
    RUNNING in the store, its process checkpointed (frozen), the checkpoint noted as under way.
    The next start gives the process its GPU state back, and the job runs on."""
    import asyncio

    from gpusched.daemon import main as daemon_main
    from tests.conftest import inprocess_config, kill_job_processes, short_tmpdir, wait_running

    config = inprocess_config(short_tmpdir(), allow_root_jobs=True, kill_grace_s=2.0)
    spec = JobSpec(argv=["sh", "-c", COUNTER], cwd="/tmp", env={"PATH": "/usr/bin:/bin"}, request=WholeRequest(gpus=1))

    async def crash_midway() -> tuple[int, int]:
        daemon = await daemon_main.start(config)
        try:
            made = await daemon.engine.submit(uid=0, gid=0, user="root", spec=spec)
            job = await wait_running(daemon.engine, made.job_id)
            tool = daemon.engine.checkpoints.tool
            assert tool is not None
            daemon.engine.checkpoints.begin(job.id, [job.pid])  # as the crashed daemon had noted...
            await tool.checkpoint(job.pid)  # ...and cuda-checkpoint had done, before the crash
            assert await tool.state(job.pid) == "checkpointed"
            return job.id, job.pid
        finally:
            await daemon_main.stop(daemon)  # knows nothing of it: the same as a crash for this job

    async def restart(job_id: int, pid: int) -> tuple[JobState, str, list[str]]:
        daemon = await daemon_main.start(config)
        try:
            job = daemon.engine.get(job_id)
            assert job is not None and daemon.engine.checkpoints.tool is not None
            state = await daemon.engine.checkpoints.tool.state(pid)
            kinds = [e.kind for e in daemon.engine.store.events(job_id=job_id)]
            await daemon.engine.cancel(job, "test over")
            return job.state, state, kinds
        finally:
            await daemon_main.stop(daemon)

    try:
        job_id, pid = asyncio.run(crash_midway())
        wait_until(lambda: _proc_state(pid) == "T", timeout=10, what="the job frozen")  # (D first, mid-write)
        state, cuda_state, kinds = asyncio.run(restart(job_id, pid))
    finally:
        kill_job_processes(config.state_dir)
    assert state is JobState.RUNNING and cuda_state == "running" and "checkpoint_repaired" in kinds
