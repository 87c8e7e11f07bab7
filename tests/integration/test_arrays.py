"""Job arrays end to end: the real CLI and daemon, real task processes, restarts.

`submit --array` creates one array and its tasks in one request; each task sees its index in
GPUSCHED_ARRAY_TASK_ID; `%MAX` keeps at most MAX of them queued or running (checked through the
tasks' states, never through timing); `cancel` takes the whole array or one task; a restart keeps
the array, its tasks and its %MAX.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import pytest
from click.testing import CliRunner, Result

from gpusched.model import ACTIVE_STATES, JobSpec, JobState, WholeRequest
from gpusched.protocol import (
    CancelRequest,
    CancelResult,
    QueueRequest,
    QueueResult,
    ShowRequest,
    ShowResult,
    SubmitRequest,
    SubmitResult,
    WaitRequest,
    WaitResult,
)
from gpusched_cli.main import cli
from tests.conftest import DaemonHandle, wait_until
from tests.integration.test_identity import as_user

OTHER_UID = 23457


@pytest.fixture
def node(daemon_factory: Callable[..., DaemonHandle]) -> DaemonHandle:
    return daemon_factory(sim="H100-80GB:4")


def gs(node: DaemonHandle, *args: str) -> Result:
    return CliRunner().invoke(cli, ["--socket", node.socket, *args], catch_exceptions=False)


def submit_array(node: DaemonHandle, spec: str, *command: str) -> int:
    result = gs(node, "submit", "--json", "--gpus", "1", "--array", spec, "--", *command)
    assert result.exit_code == 0, result.output
    reply = json.loads(result.stdout)
    return int(reply["job_id"])


def tasks(node: DaemonHandle) -> dict[int, Any]:
    """Task index -> summary, for the (single) array on the node."""
    with node.client() as c:
        rows = c.call(QueueRequest(all=True, array_tasks=True), QueueResult).jobs
    return {r.array_task: r for r in rows if r.array_task is not None}


def states(node: DaemonHandle) -> dict[int, JobState]:
    return {i: r.state for i, r in tasks(node).items()}


# ---- submission and errors -----------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "needle"), [
    ("5-1", "ends before it starts"),
    ("1-10:0", "step must be at least 1"),
    ("x", "is not an index or a range"),
    ("1-4%0", "at least one task"),
    ("", "is empty"),
])
def test_bad_array_spec_is_refused_by_the_client_naming_the_flag(node: DaemonHandle, spec: str, needle: str) -> None:
    result = gs(node, "submit", "--gpus", "1", "--array", spec, "--", "true")
    assert result.exit_code == 2, result.output
    assert "--array" in result.stderr and needle in result.stderr


def test_bad_array_spec_is_refused_by_the_daemon_naming_the_field(node: DaemonHandle) -> None:
    spec = JobSpec(argv=["true"], cwd="/tmp", request=WholeRequest(gpus=1))
    with node.client() as c:
        reply = c.raw_call({"op": "submit", "spec": spec.model_dump(mode="json"), "array": "3-1"})
        assert reply["error"]["code"] == "bad_request" and reply["error"]["message"].startswith("array:")
        assert c.call(QueueRequest(), QueueResult).jobs == []  # the daemon keeps serving, nothing queued


def test_array_bigger_than_max_array_size_is_refused(daemon_factory: Callable[..., DaemonHandle]) -> None:
    node = daemon_factory(max_array_size=5)
    result = gs(node, "submit", "--gpus", "1", "--array", "1-6", "--", "true")
    assert result.exit_code == 8, result.output  # limit_exceeded
    assert "max_array_size" in result.stderr and "6 tasks" in result.stderr
    assert submit_array(node, "1-5", "true") > 0


def test_each_task_counts_against_max_pending_per_user(daemon_factory: Callable[..., DaemonHandle]) -> None:
    node = daemon_factory(max_pending_per_user=5)
    spec = JobSpec(argv=["true"], cwd="/tmp", env={"PATH": "/usr/bin:/bin"}, request=WholeRequest(gpus=1))
    message = {"op": "submit", "spec": spec.model_dump(mode="json"), "hold": True}
    too_many, fits, one_more = as_user(OTHER_UID, node.socket, {**message, "array": "1-6"},
                                       {**message, "array": "1-5"}, message)
    assert too_many["error"]["code"] == "limit_exceeded" and "6 tasks" in too_many["error"]["message"]
    assert fits["ok"] and fits["result"]["tasks"] == 5
    assert one_more["error"]["code"] == "limit_exceeded"


def test_ten_thousand_tasks_are_one_request_and_one_queue_row(node: DaemonHandle) -> None:
    array_id = submit_array(node, "1-10000%4", "sleep", "60")
    result = gs(node, "queue", "--json")
    listing = json.loads(result.stdout)
    assert listing["jobs"] == []
    [row] = listing["arrays"]
    assert (row["id"], row["spec"], row["tasks"], row["max_running"]) == (array_id, "1-10000%4", 10000, 4)
    assert sum(row["states"].values()) == 10000
    text = gs(node, "queue").stdout
    assert f"{array_id}_[1-10000%4]" in text and len(text.splitlines()) == 2  # the header and one row
    with node.client() as c:
        assert c.call(ShowRequest(job_id=array_id, task=10000), ShowResult).job.array_task == 10000


# ---- what a task sees --------------------------------------------------------------------------


def test_each_task_sees_its_index_in_the_environment(node: DaemonHandle) -> None:
    array_id = submit_array(node, "0-8:4", "sh", "-c", "echo $GPUSCHED_ARRAY_JOB_ID $GPUSCHED_ARRAY_TASK_ID "
                            "$GPUSCHED_ARRAY_TASK_MIN $GPUSCHED_ARRAY_TASK_MAX $GPUSCHED_ARRAY_TASK_COUNT "
                            "$GPUSCHED_ARRAY_TASK_STEP")
    wait_until(lambda: set(states(node).values()) == {JobState.COMPLETED}, timeout=30, what="all tasks completed")
    for task in (0, 4, 8):
        logs = gs(node, "logs", f"{array_id}_{task}")
        assert logs.exit_code == 0, logs.output
        assert logs.stdout == f"{array_id} {task} 0 8 3 4\n"
    shown = gs(node, "show", f"{array_id}_4").stdout
    assert f"= {array_id}_4" in shown and "GPUSCHED_ARRAY_TASK_ID=4" in shown
    assert gs(node, "logs", f"{array_id}_5").exit_code == 4  # no task 5 in 0-8:4
    plain = gs(node, "logs", str(array_id))
    assert plain.exit_code == 4 and f"{array_id}_0" in plain.stderr  # says how to name a task


# ---- %MAX ------------------------------------------------------------------------------------------


def test_percent_max_caps_running_tasks_lowest_first(node: DaemonHandle) -> None:
    array_id = submit_array(node, "1-6%2", "sleep", "60")  # 4 GPUs: only %2 keeps the others waiting
    wait_until(lambda: [i for i, s in states(node).items() if s in ACTIVE_STATES] == [1, 2], what="tasks 1, 2 run")
    assert {i: s for i, s in states(node).items() if i > 2} == dict.fromkeys(range(3, 7), JobState.PENDING)
    assert gs(node, "cancel", f"{array_id}_1").exit_code == 0
    wait_until(lambda: [i for i, s in states(node).items() if s in ACTIVE_STATES] == [2, 3], what="task 3 runs")
    # Held tasks free their place too, and a released one waits for a place again.
    assert gs(node, "hold", *(str(tasks(node)[i].id) for i in (4, 5))).exit_code == 0
    assert gs(node, "cancel", f"{array_id}_2").exit_code == 0
    wait_until(lambda: [i for i, s in states(node).items() if s is JobState.RUNNING] == [3, 6], what="task 6 runs")
    assert gs(node, "release", str(tasks(node)[4].id)).exit_code == 0
    assert states(node)[4] is JobState.PENDING
    with node.client() as c:
        [row] = c.call(QueueRequest(), QueueResult).arrays
    assert row.states == {"CANCELLED": 2, "HELD": 1, "PENDING": 1, "RUNNING": 2} and row.pending == "4-5"


def test_restart_keeps_the_array_its_tasks_and_its_cap(node: DaemonHandle) -> None:
    array_id = submit_array(node, "1-5%1", "sleep", "60")
    wait_until(lambda: states(node)[1] is JobState.RUNNING, what="task 1 running")
    node.restart()
    assert states(node) == {1: JobState.RUNNING, **dict.fromkeys(range(2, 6), JobState.PENDING)}
    assert gs(node, "cancel", f"{array_id}_1").exit_code == 0
    wait_until(lambda: states(node)[2] is JobState.RUNNING, what="task 2 running after task 1 ended")
    assert [s for s in states(node).values() if s in ACTIVE_STATES] == [JobState.RUNNING]
    shown = gs(node, "show", str(array_id))
    assert shown.exit_code == 0 and f"array {array_id}_[1-5%1]: 5 tasks, at most 1 at once" in shown.stdout


# ---- cancel -----------------------------------------------------------------------------------------


def test_cancel_one_task_then_the_whole_array(node: DaemonHandle) -> None:
    array_id = submit_array(node, "1,3,5-7", "sleep", "60")
    assert sorted(tasks(node)) == [1, 3, 5, 6, 7]
    result = gs(node, "cancel", f"{array_id}_3")
    assert result.exit_code == 0 and f"Cancelled job {tasks(node)[3].id}" in result.stdout
    wait_until(lambda: states(node)[3] is JobState.CANCELLED, what="task 3 cancelled")
    assert JobState.CANCELLED not in [s for i, s in states(node).items() if i != 3]
    result = gs(node, "cancel", str(array_id))
    assert result.exit_code == 0 and f"Array {array_id}" in result.stdout
    wait_until(lambda: set(states(node).values()) == {JobState.CANCELLED}, what="every task cancelled")
    assert gs(node, "cancel", f"{array_id}_9").exit_code == 4  # no such task: nothing cancelled, exit 4


def test_another_user_may_not_cancel_an_array(node: DaemonHandle) -> None:
    array_id = submit_array(node, "1-3", "sleep", "60")
    [reply] = as_user(OTHER_UID, node.socket, {"op": "cancel", "job_ids": [array_id]})
    assert reply["error"]["code"] == "permission_denied"
    assert JobState.CANCELLED not in states(node).values()


def test_hold_at_submission_holds_every_task(node: DaemonHandle) -> None:
    spec = JobSpec(argv=["true"], cwd="/tmp", request=WholeRequest(gpus=1))
    with node.client() as c:
        made = c.call(SubmitRequest(spec=spec, hold=True, array="1-3"), SubmitResult)
    assert made.tasks == 3 and made.state is JobState.HELD
    assert set(states(node).values()) == {JobState.HELD}
    assert os.path.exists(node.state_dir)


def test_queue_all_lists_finished_arrays_without_crowding_out_other_jobs(node: DaemonHandle) -> None:
    array_id = submit_array(node, "1-5", "true")
    wait_until(lambda: set(states(node).values()) == {JobState.COMPLETED}, timeout=30, what="the array completed")
    plain = [json.loads(gs(node, "submit", "--json", "--gpus", "1", "--", "true").stdout)["job_id"] for _ in range(2)]
    with node.client() as c:
        wait_until(lambda: not c.call(QueueRequest(), QueueResult).jobs, timeout=30, what="the plain jobs ended")
        listing = c.call(QueueRequest(all=True, limit=3), QueueResult)
        cut = c.call(QueueRequest(all=True, limit=2), QueueResult)
    assert [j.id for j in listing.jobs] == plain  # the array's 5 finished tasks do not take the rows
    assert ([j.id for j in cut.jobs], cut.arrays, cut.arrays_total) == (plain, [], 1)  # its row counts, after them
    [row] = listing.arrays
    assert (row.id, row.states, row.pending) == (array_id, {"COMPLETED": 5}, "")


def test_tasks_changed_before_the_hand_over_reach_the_scheduler_once_and_as_they_are_now(
    daemon: DaemonHandle,
) -> None:
    """The scheduler gets an array's tasks a chunk at a time after the answer; a task cancelled, or
    held and released, in between must end up queued exactly as its state says."""
    import asyncio

    assert daemon.daemon is not None and daemon.loop is not None
    engine = daemon.daemon.engine
    spec = JobSpec(argv=["sleep", "60"], cwd="/tmp", request=WholeRequest(gpus=2))

    async def scenario() -> tuple[list[int], set[int], int]:
        await engine.submit(uid=0, gid=0, user="root", spec=spec)  # holds both GPUs: nothing else starts
        made = await engine.submit(uid=0, gid=0, user="root", spec=spec, array="1-1200")
        ids = engine.store.task_ids(made.job_id)
        pending_handover = len(engine._handing)
        assert await engine.cancel(engine.jobs[ids[0]], "cancelled")
        assert engine.hold(engine.jobs[ids[700]], "held") is None
        assert engine.release(engine.jobs[ids[700]], "released") is None
        assert engine.hold(engine.jobs[ids[1100]], "held") is None
        while engine._handing:
            await asyncio.sleep(0)
        return ids, engine.scheduler.queue.job_ids(), pending_handover

    ids, queued, pending_handover = asyncio.run_coroutine_threadsafe(scenario(), daemon.loop).result(30)
    assert pending_handover == 1200  # the answer came before any task reached the scheduler
    assert queued == set(ids) - {ids[0], ids[1100]}


# ---- hold, release, suspend, resume, --after and wait on an array ---------------------------------


def test_hold_and_release_an_array_act_on_its_tasks_in_the_right_state(node: DaemonHandle) -> None:
    array_id = submit_array(node, "1-6", "sleep", "60")  # 4 GPUs: tasks 1-4 run, 5-6 wait
    wait_until(lambda: [i for i, s in states(node).items() if s is JobState.RUNNING] == [1, 2, 3, 4],
               what="tasks 1-4 running")
    ids = {i: r.id for i, r in tasks(node).items()}
    held = gs(node, "hold", str(array_id))
    assert held.exit_code == 0, held.output
    assert f"Array {array_id}:" in held.stdout and f"Held jobs {ids[5]}, {ids[6]}" in held.stdout
    assert "unchanged" not in held.stdout  # the running tasks are not a line each
    assert states(node) == {**dict.fromkeys(range(1, 5), JobState.RUNNING), 5: JobState.HELD, 6: JobState.HELD}
    [reply] = as_user(OTHER_UID, node.socket, {"op": "release", "job_ids": [array_id]})
    assert reply["error"]["code"] == "permission_denied"
    assert states(node)[5] is JobState.HELD
    released = gs(node, "release", "--", str(array_id))
    assert released.exit_code == 0 and f"Released jobs {ids[5]}, {ids[6]}" in released.stdout
    assert {states(node)[5], states(node)[6]} == {JobState.PENDING}
    assert gs(node, "hold", "999999").exit_code == 4  # neither a job nor an array: nothing held


def test_suspend_and_resume_an_array(node: DaemonHandle) -> None:
    array_id = submit_array(node, "1-3", "sleep", "60")
    wait_until(lambda: set(states(node).values()) == {JobState.RUNNING}, what="every task running")
    assert gs(node, "suspend", str(array_id)).exit_code == 0
    assert set(states(node).values()) == {JobState.SUSPENDED}
    assert gs(node, "resume", str(array_id)).exit_code == 0
    assert set(states(node).values()) == {JobState.RUNNING}


def test_job_control_takes_a_single_array_task(node: DaemonHandle) -> None:
    """`hold 120_5` / `release 120_5` / `suspend 120_1` / `resume 120_1` act on that task alone."""
    array_id = submit_array(node, "1-6", "sleep", "60")  # 4 GPUs: tasks 1-4 run, 5-6 wait
    wait_until(lambda: [i for i, s in states(node).items() if s is JobState.RUNNING] == [1, 2, 3, 4],
               what="tasks 1-4 running")
    ids = {i: r.id for i, r in tasks(node).items()}
    held = gs(node, "hold", f"{array_id}_5")
    assert held.exit_code == 0 and f"Held job {ids[5]}" in held.stdout, held.output
    assert states(node)[5] is JobState.HELD and states(node)[6] is JobState.PENDING
    assert gs(node, "release", f"{array_id}_5").exit_code == 0
    assert states(node)[5] is JobState.PENDING
    assert gs(node, "suspend", f"{array_id}_1").exit_code == 0
    assert states(node)[1] is JobState.SUSPENDED and states(node)[2] is JobState.RUNNING
    assert gs(node, "resume", f"{array_id}_1").exit_code == 0
    assert states(node)[1] is JobState.RUNNING
    [reply] = as_user(OTHER_UID, node.socket, {"op": "hold", "tasks": [{"array_id": array_id, "task": 6}]})
    assert reply["error"]["code"] == "permission_denied" and states(node)[6] is JobState.PENDING
    missing = gs(node, "hold", f"{array_id}_99")
    assert missing.exit_code == 4 and "has no task 99" in missing.output, missing.output


def test_holding_a_big_array_commits_in_bounded_chunks(node: DaemonHandle) -> None:
    spec = JobSpec(argv=["sleep", "60"], cwd="/tmp", request=WholeRequest(gpus=4))
    with node.client() as c:
        c.call(SubmitRequest(spec=spec), SubmitResult)  # holds every GPU: the tasks all stay PENDING
        array_id = c.call(SubmitRequest(spec=spec, array="1-1200"), SubmitResult).job_id
    assert node.daemon is not None
    store = node.daemon.store
    batches: list[int] = []
    real_batch = store.batch

    def counting_batch():  # type: ignore[no-untyped-def]
        batches.append(1)
        return real_batch()

    store.batch = counting_batch  # type: ignore[method-assign]
    try:
        with node.client() as c:
            result = c.request({"op": "hold", "job_ids": [array_id]})
    finally:
        del store.batch
    assert len(result["changed"]) == 1200 and result["arrays"] == [array_id]
    assert len(batches) == 3  # one COMMIT per 500 tasks, not one per task nor one for all
    assert set(states(node).values()) == {JobState.HELD}


def test_after_an_array_waits_for_all_its_tasks_and_fails_if_one_did_not_complete(node: DaemonHandle) -> None:
    array_id = submit_array(node, "1-2", "sleep", "60")
    wait_until(lambda: set(states(node).values()) == {JobState.RUNNING}, what="both tasks running")
    dependent = json.loads(gs(node, "submit", "--json", "--gpus", "1", "--after", str(array_id), "--",
                              "true").stdout)["job_id"]
    with node.client() as c:
        shown = c.call(ShowRequest(job_id=dependent), ShowResult)
    assert shown.job.state is JobState.PENDING
    assert shown.waiting_reason == f"waiting for array {array_id} to complete"
    assert gs(node, "cancel", f"{array_id}_1").exit_code == 0
    wait_until(lambda: states(node)[1] is JobState.CANCELLED, what="task 1 cancelled")
    with node.client() as c:  # one task is still running: the dependency is not decided yet
        c.call(WaitRequest(job_id=dependent, timeout_s=0.5), WaitResult)
        assert c.call(ShowRequest(job_id=dependent), ShowResult).job.state is JobState.PENDING
    assert gs(node, "cancel", f"{array_id}_2").exit_code == 0
    with node.client() as c:
        waited = wait_until(lambda: (r := c.call(WaitRequest(job_id=dependent, timeout_s=5), WaitResult)).finished
                            and r, timeout=20, what="the dependent failed")
    assert waited is not False
    ended = waited.job
    assert ended.state is JobState.FAILED
    assert ended.reason == f"dependency can never be met: array {array_id} ended CANCELLED, needed COMPLETED"


def test_after_an_array_any_starts_once_every_task_has_ended(node: DaemonHandle) -> None:
    array_id = submit_array(node, "1-2", "sleep", "60")
    dependent = json.loads(gs(node, "submit", "--json", "--gpus", "1", "--after", f"{array_id}:any", "--",
                              "true").stdout)["job_id"]
    assert gs(node, "cancel", f"{array_id}_1").exit_code == 0
    with node.client() as c:
        c.call(WaitRequest(job_id=dependent, timeout_s=0.5), WaitResult)
        assert c.call(ShowRequest(job_id=dependent), ShowResult).job.state is JobState.PENDING
    assert gs(node, "cancel", str(array_id)).exit_code == 0
    result = gs(node, "wait", str(dependent))
    assert result.exit_code == 0 and "COMPLETED" in result.stderr


def test_after_an_array_ok_starts_after_every_task_completed(node: DaemonHandle) -> None:
    array_id = submit_array(node, "1-3", "sh", "-c", "sleep 0.3")
    dependent = json.loads(gs(node, "submit", "--json", "--gpus", "1", "--after", str(array_id), "--",
                              "true").stdout)["job_id"]
    result = gs(node, "wait", str(dependent))
    assert result.exit_code == 0, result.output
    with node.client() as c:
        job = c.call(ShowRequest(job_id=dependent), ShowResult).job
    assert set(states(node).values()) == {JobState.COMPLETED}
    assert job.started_at is not None
    assert all(r.ended_at is not None and r.ended_at <= job.started_at for r in tasks(node).values())


def test_after_an_array_task_waits_for_that_task_only(node: DaemonHandle) -> None:
    """`--after 120_1` names task 1's job: the dependent starts once it completed, while task 2 runs on."""
    array_id = submit_array(node, "1-2", "sh", "-c", 'if [ "$GPUSCHED_ARRAY_TASK_ID" = 2 ]; then sleep 60; fi')
    dependent = json.loads(gs(node, "submit", "--json", "--gpus", "1", "--after", f"{array_id}_1", "--",
                              "true").stdout)["job_id"]
    with node.client() as c:
        spec = c.call(ShowRequest(job_id=dependent), ShowResult).job.spec
    assert [d.job_id for d in spec.after] == [tasks(node)[1].id]
    assert gs(node, "wait", str(dependent)).exit_code == 0
    assert states(node)[2] is JobState.RUNNING
    missing = gs(node, "submit", "--gpus", "1", "--after", f"{array_id}_9", "--", "true")
    assert missing.exit_code == 4 and "has no task 9" in missing.output, missing.output
    assert gs(node, "cancel", str(array_id)).exit_code == 0


def test_wait_takes_an_array_task_and_exits_with_its_status(node: DaemonHandle) -> None:
    array_id = submit_array(node, "1-2", "sh", "-c", 'exit "$GPUSCHED_ARRAY_TASK_ID"')
    result = gs(node, "wait", f"{array_id}_2")
    assert result.exit_code == 2, result.output
    assert f"Job {tasks(node)[2].id} FAILED" in result.stderr
    as_json = gs(node, "wait", "--json", f"{array_id}_1")
    assert as_json.exit_code == 1 and json.loads(as_json.stdout)["job_id"] == tasks(node)[1].id
    whole = gs(node, "wait", str(array_id))  # an array is not one job: the error says how to name a task
    assert whole.exit_code == 4 and f"{array_id}_1" in whole.stderr
    assert gs(node, "wait", f"{array_id}_9").exit_code == 4


def test_show_of_a_task_held_back_by_the_arrays_max_says_so(daemon_factory: Callable[..., DaemonHandle]) -> None:
    """`show` said "job N is not pending" and blamed a MIG change, for a PENDING task the scheduler had
    not got yet because of its array's %MAX (scheduling audit)."""
    node = daemon_factory(sim="H100-80GB:2")
    spec = JobSpec(argv=["sleep", "30"], cwd="/tmp", request=WholeRequest(gpus=1))
    with node.client() as c:
        made = c.call(SubmitRequest(spec=spec, array="0-3%1"), SubmitResult)
        first, second = made.job_id + 1, made.job_id + 2
        wait_until(lambda: c.call(ShowRequest(job_id=first), ShowResult).job.state is JobState.RUNNING,
                   what="the first task to run")
        shown = c.call(ShowRequest(job_id=second), ShowResult)
        c.call(CancelRequest(job_ids=[made.job_id]), CancelResult)
    assert shown.job.state is JobState.PENDING
    assert shown.waiting_reason == (f"waiting for array {made.job_id}'s %1: 1 of its tasks are queued or running; "
                                    "it is handed over when one of them ends"), shown.waiting_reason


def test_a_capped_array_whose_dependency_fails_fails_every_task_at_once(
        daemon_factory: Callable[..., DaemonHandle]) -> None:
    """Only the tasks %MAX let through were checked: the others failed MAX per tick (40 s for this
    array at the default 1 s tick, hours for a 10,000-task one), listed PENDING all that time."""
    node = daemon_factory(sim="H100-80GB:2", tick_s=1.0)
    bad = json.loads(gs(node, "submit", "--json", "--gpus", "1", "--", "sh", "-c", "exit 3").stdout)["job_id"]
    with node.client() as c:
        assert c.call(WaitRequest(job_id=bad, timeout_s=10), WaitResult).job.state is JobState.FAILED
    array = json.loads(gs(node, "submit", "--json", "--gpus", "1", "--array", "0-39%1", "--after", str(bad), "--",
                          "true").stdout)["job_id"]

    def failed() -> bool:
        with node.client() as c:
            rows = c.call(QueueRequest(all=True), QueueResult).arrays
        return next(r.states for r in rows if r.id == array) == {"FAILED": 40}

    wait_until(failed, timeout=8, what="all 40 tasks failed (one per tick would take 40 s)")
