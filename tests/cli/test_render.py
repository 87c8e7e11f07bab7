"""Human output, checked without a daemon: every command's text comes from these pure functions."""

from __future__ import annotations

import re
from datetime import UTC

import pytest

from gpusched.model import (
    AllocatedDevice,
    Allocation,
    Job,
    JobSpec,
    JobState,
    MigRequest,
    Transition,
    WholeRequest,
)
from gpusched.protocol import (
    ArraySummary,
    CancelResult,
    GpuInfo,
    GpusResult,
    InstanceInfo,
    JobSummary,
    RuntimeEstimate,
    ShowResult,
)
from gpusched_cli import render
from gpusched_cli.main import EXIT_JOB_CANCELLED, EXIT_JOB_LOST, EXIT_JOB_NOT_RUN, EXIT_JOB_TIMEOUT, job_exit_status

T0 = 1_700_000_000.0  # 2023-11-14 22:13:20 UTC


@pytest.mark.parametrize(
    ("mib", "text"),
    [(0, "0 MiB"), (512, "512 MiB"), (1023, "1023 MiB"), (1024, "1 GiB"), (1536, "1.5 GiB"),
     (81920, "80 GiB"), (81559, "79.6 GiB"), (1024 * 1024, "1 TiB")],
)
def test_format_mib(mib: int, text: str) -> None:
    assert render.format_mib(mib) == text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0:00"), (-3, "0:00"), (5.9, "0:05"), (65, "1:05"), (3600, "1:00:00"), (3723, "1:02:03"),
     (86400, "1-00:00:00"), (2 * 86400 + 3661, "2-01:01:01")],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert render.format_duration(seconds) == text


def test_format_time_is_local_wall_clock() -> None:
    assert render.format_time(T0, UTC) == "2023-11-14 22:13:20"
    assert render.format_time(None) == "-"


def test_format_signal() -> None:
    assert render.format_signal(9) == "9 (SIGKILL)"
    assert render.format_signal(200) == "200"


def test_short_device() -> None:
    assert render.short_device("GPU-1a2b3c4d-0000-1111-2222-333344445555") == "GPU-1a2b3c4d"
    assert render.short_device("MIG-deadbeef-0000-1111-2222-333344445555") == "MIG-deadbeef"
    assert render.short_device("0:3g.40gb") == "0:3g.40gb"


def test_table_aligns_columns_without_trailing_blanks() -> None:
    text = render.table(("A", "BB", "C"), [("xxx", "y", ""), ("1", "22", "333")])
    assert text.splitlines() == ["A    BB  C", "xxx  y", "1    22  333"]


def _summary(**kw: object) -> JobSummary:
    base: dict[str, object] = dict(
        id=7, name="train", user="alice", uid=1000, state=JobState.RUNNING, request="gpus=2",
        submitted_at=T0, started_at=T0 + 10, ended_at=None, exit_code=None,
        devices=["GPU-1a2b3c4d-0000-1111-2222-333344445555", "GPU-99999999-0000-1111-2222-333344445555"],
        reason="",
    )
    base.update(kw)
    return JobSummary.model_validate(base)


def test_queue_table() -> None:
    jobs = [
        _summary(),
        _summary(id=8, name="eval", user="bob", state=JobState.PENDING, request="mig=3g.40gb",
                 started_at=None, devices=[], reason="waiting for 3g.40gb"),
    ]
    lines = render.queue_table(jobs, now=T0 + 75).splitlines()
    assert lines[0].split() == ["ID", "NAME", "USER", "STATE", "REQUEST", "DEVICES", "WAIT/RUNTIME", "REASON"]
    assert lines[1].split() == ["7", "train", "alice", "RUNNING", "gpus=2", "GPU-1a2b3c4d,GPU-99999999", "1:05", "-"]
    assert lines[2].split()[:7] == ["8", "eval", "bob", "PENDING", "mig=3g.40gb", "-", "1:15"]
    assert lines[2].endswith("waiting for 3g.40gb")
    assert render.queue_table([], now=T0) == "No jobs."


def test_queue_table_names_devices_by_index_and_instance() -> None:
    inst = InstanceInfo(uuid="MIG-aaaaaaaa-0000-1111-2222-333344445555", profile="3g.40gb", start=4, size=4,
                        memory_mib=40192, sm_count=60, health="ok", jobs=[7], users=["alice"])
    gpus = GpusResult(backend="sim", driver_version="1", gpus=[_gpu(0), _gpu(1, mig_enabled=True, instances=[inst])])
    labels = render.device_labels(gpus)
    job = _summary(devices=["GPU-00000000-0000-1111-2222-333344445555", inst.uuid,
                            "GPU-77777777-0000-1111-2222-333344445555"])
    row = render.queue_table([job], now=T0 + 10, labels=labels).splitlines()[1]
    assert "gpu0,gpu1:3g.40gb@4,GPU-77777777" in row


def test_elapsed_of_finished_job_is_its_runtime() -> None:
    job = _summary(state=JobState.COMPLETED, ended_at=T0 + 70, exit_code=0)
    assert render.elapsed(job, now=T0 + 10_000) == 60
    never_ran = _summary(state=JobState.CANCELLED, started_at=None, ended_at=T0 + 5)
    assert render.elapsed(never_ran, now=T0 + 10_000) == 5


def _job(**kw: object) -> Job:
    spec = JobSpec(argv=["python", "train.py", "--lr", "3e-4 x"], cwd="/home/alice", env={"A": "1"},
                   request=WholeRequest(gpus=1), time_limit_s=3600, name="train")
    base: dict[str, object] = dict(id=7, uid=1000, gid=1000, user="alice", spec=spec, state=JobState.COMPLETED,
                                   submitted_at=T0)
    base.update(kw)
    return Job.model_validate(base)


def test_show_text_has_spec_allocation_exit_and_history() -> None:
    job = _job(
        started_at=T0 + 2, ended_at=T0 + 62, exit_code=0,
        allocation=Allocation(
            devices=[AllocatedDevice(uuid="GPU-1a2b3c4d-0000-1111-2222-333344445555", gpu_index=0, kind="gpu")],
            compute_fraction=1.0, env={"CUDA_VISIBLE_DEVICES": "GPU-1a2b3c4d-0000-1111-2222-333344445555"},
        ),
        history=[Transition(state=JobState.PENDING, at=T0, reason="submitted"),
                 Transition(state=JobState.RUNNING, at=T0 + 2, reason="started on GPU 0"),
                 Transition(state=JobState.COMPLETED, at=T0 + 62, reason="exited 0")],
    )
    text = render.show_text(ShowResult(job=job, log_path="/var/lib/gpusched/logs/7.log"), now=T0 + 100, tz=UTC)
    assert text.splitlines()[0] == "Job 7 (train)  COMPLETED"
    assert "command     python train.py --lr '3e-4 x'" in text
    assert "cwd         /home/alice" in text
    assert "request     gpus=1" in text
    assert "time limit  1:00:00" in text
    assert "runtime     1:00" in text
    assert "result      exit code 0" in text
    assert "GPU-1a2b3c4d-0000-1111-2222-333344445555 (GPU 0)" in text
    assert "env added   CUDA_VISIBLE_DEVICES=GPU-1a2b3c4d" in text
    assert "log         /var/lib/gpusched/logs/7.log" in text
    assert "2023-11-14 22:13:22  RUNNING    started on GPU 0" in text


def test_show_text_of_pending_job_says_why_it_waits() -> None:
    job = _job(state=JobState.PENDING, spec=_job().spec.model_copy(update={"request": MigRequest(profile="7g.80gb")}))
    text = render.show_text(ShowResult(job=job, waiting_reason="no free 7g.80gb slot"), now=T0 + 30, tz=UTC)
    assert "waiting for  no free 7g.80gb slot" in text
    assert "request      mig=7g.80gb" in text
    assert "result" not in text


def test_show_text_gives_the_estimate_and_when_a_job_should_start() -> None:
    job = _job(state=JobState.PENDING)
    est = RuntimeEstimate(runtime_s=5400.0, source="your previous runs of this command",
                          expected_start_at=T0 + 30 + 600)
    text = render.show_text(ShowResult(job=job, estimate=est), now=T0 + 30, tz=UTC)
    assert re.search(r"estimate +1:30:00 \(your previous runs of this command\)", text)
    assert re.search(r"est\. start +2023-11-14 22:23:50 \(in 10:00\)", text)
    short = RuntimeEstimate(runtime_s=0.3, source="previous jobs of this shape")
    text = render.show_text(ShowResult(job=job, estimate=short), now=T0 + 30, tz=UTC)
    assert re.search(r"estimate +0\.3 s \(previous jobs of this shape\)", text)
    assert re.search(r"est\. start +unknown \(needs a MIG change, or too many jobs ahead\)", text)
    after = render.show_text(ShowResult(job=job, estimate=short, waiting_reason="waiting for job 117 to complete"),
                             now=T0 + 30, tz=UTC)  # not in the scheduler's queue yet: no guess about MIG
    assert re.search(r"est\. start +unknown \(once what it waits for has ended\)", after)


def _gpu(index: int, **kw: object) -> GpuInfo:
    base: dict[str, object] = dict(
        index=index, uuid=f"GPU-{index:08d}-0000-1111-2222-333344445555", name="NVIDIA H100 80GB HBM3",
        model="H100-80GB", memory_total_mib=81559, memory_used_mib=0, sm_count=132, mig_enabled=False,
        mig_pending=False, health="ok", instances=[], jobs=[], users=[],
    )
    base.update(kw)
    return GpuInfo.model_validate(base)


def test_gpus_text_whole_and_mig() -> None:
    inst = InstanceInfo(uuid="MIG-aaaaaaaa-0000-1111-2222-333344445555", profile="3g.40gb", start=4, size=4,
                        memory_mib=40192, sm_count=60, health="ok", jobs=[12], users=["bob"])
    result = GpusResult(backend="sim", driver_version="550.54.15", gpus=[
        _gpu(0, jobs=[3], users=["alice"]),
        _gpu(1, mig_enabled=True, mig_pending=True, instances=[inst]),
        _gpu(2, mig_pending=True),
    ])
    text = render.gpus_text(result)
    assert "GPU 0  H100-80GB  NVIDIA H100 80GB HBM3  GPU-00000000" in text
    assert "memory 79.6 GiB, 0 MiB used, 132 SMs, MIG off, share exclusive, health ok" in text
    assert "jobs: 3 (alice)" in text
    assert "MIG on," in text
    row = next(line for line in text.splitlines() if "3g.40gb" in line)
    assert row.split()[:6] == ["3g.40gb", "-", "4:4", "39.2", "GiB", "60"]
    assert row.endswith("12 (bob)")
    assert "MIG off (pending on after reset)" in text


def test_cancel_text() -> None:
    assert render.cancel_text(CancelResult(cancelled=[3], already_finished=[])) == "Cancelled job 3"
    text = render.cancel_text(CancelResult(cancelled=[3, 4], already_finished=[5]))
    assert text == "Cancelled jobs 3, 4\nJob 5 had already finished"
    assert render.cancel_text(CancelResult(cancelled=[])) == "Nothing to cancel."


def test_final_state_text() -> None:
    assert render.final_state_text(_job(exit_code=0)) == "Job 7 COMPLETED, exit code 0"
    killed = _job(state=JobState.FAILED, signal=9, reason="killed by signal 9")
    assert render.final_state_text(killed) == "Job 7 FAILED, killed by signal 9 (SIGKILL)"
    not_run = _job(state=JobState.FAILED, reason="cannot execute: no such file")
    assert render.final_state_text(not_run) == "Job 7 FAILED: cannot execute: no such file"
    timeout = _job(state=JobState.TIMEOUT, signal=15, reason="time limit 1:00 reached")
    text = "Job 7 TIMEOUT, killed by signal 15 (SIGTERM): time limit 1:00 reached"
    assert render.final_state_text(timeout) == text


@pytest.mark.parametrize(
    ("kw", "status"),
    [
        (dict(state=JobState.COMPLETED, exit_code=0), 0),
        (dict(state=JobState.FAILED, exit_code=3), 3),
        (dict(state=JobState.FAILED, exit_code=300), 300 & 0xFF),
        (dict(state=JobState.FAILED, signal=9), 137),
        (dict(state=JobState.FAILED), EXIT_JOB_NOT_RUN),
        (dict(state=JobState.CANCELLED, signal=15), EXIT_JOB_CANCELLED),
        (dict(state=JobState.TIMEOUT, signal=15), EXIT_JOB_TIMEOUT),
        (dict(state=JobState.LOST), EXIT_JOB_LOST),
    ],
)
def test_job_exit_status(kw: dict[str, object], status: int) -> None:
    assert job_exit_status(_job(**kw)) == status


@pytest.mark.parametrize("raw, shown", [
    ("\x1b[2J", "\\x1b[2J"),  # clear screen
    ("\x1b]52;c;ZXZpbA==\x07", "\\x1b]52;c;ZXZpbA==\\x07"),  # OSC 52: write the clipboard
    ("a\x9b31mb", "a\\x9b31mb"),  # one-byte CSI (C1)
    ("x\u202ey\u200bz", "x\\u202ey\\u200bz"),  # bidi override, zero-width space
    ("tab\tand\nnewline", "tab\tand\nnewline"),  # kept outside table cells
    ("plain, ünïcödé 😀", "plain, ünïcödé 😀"),
])
def test_printable_escapes_what_a_terminal_would_act_on(raw: str, shown: str) -> None:
    assert render.printable(raw) == shown


def test_table_cells_escape_newlines_and_controls() -> None:
    text = render.table(("A", "B"), [("x\ny", "\x1b[31mred")])
    assert text.splitlines()[1] == "x\\x0ay  \\x1b[31mred"


def test_queue_shows_an_array_as_one_row_among_jobs_in_id_order() -> None:
    array = ArraySummary(id=120, name="sweep", user="alice", uid=1000, request="gpus=1", submitted_at=T0 - 190,
                         spec="1-10000%8", tasks=10000, max_running=8,
                         states={"COMPLETED": 2, "PENDING": 9990, "RUNNING": 8}, pending="11-10000")
    lines = render.queue_table([_summary(id=7), _summary(id=200)], T0, arrays=[array]).splitlines()
    assert [line.split()[0] for line in lines] == ["ID", "7", "120_[1-10000%8]", "200"]
    assert lines[2].split()[3:] == ["RUNNING:8,PENDING:9990,COMPLETED:2", "gpus=1", "-", "3:10", "pending", "11-10000"]
    assert render.queue_table([], T0, arrays=[array]).count("\n") == 1
    task = _summary(id=127, array_id=120, array_task=7)
    assert render.queue_table([task], T0).splitlines()[1].split()[0] == "120_7"


def test_cancel_of_a_whole_array_writes_runs_of_ids() -> None:
    text = render.cancel_text(CancelResult(cancelled=list(range(121, 10121)), arrays=[120]))
    assert text.splitlines() == ["Array 120: its unfinished tasks are cancelled", "Cancelled jobs 121-10120"]
    assert render.cancel_text(CancelResult(cancelled=[3, 5])) == "Cancelled jobs 3, 5"
