"""The client's plain JSON requests are byte for byte what the protocol's models send, and the
shortcuts it takes to avoid pydantic (copied limits, state names, render helpers) agree with the model."""

from __future__ import annotations

from typing import Any

import click
import pytest
from pydantic import BaseModel

from gpusched import model
from gpusched.model import Dependency, JobSpec, MigRequest, ShareRequest, WholeRequest
from gpusched.protocol import (
    CancelRequest,
    DoctorRequest,
    GpuDrainRequest,
    GpuResumeRequest,
    GpusRequest,
    HelloRequest,
    HoldRequest,
    LogsRequest,
    MigApplyRequest,
    ProtocolError,
    QueueRequest,
    ReleaseRequest,
    ReloadRequest,
    ResumeRequest,
    ShowRequest,
    ShutdownRequest,
    SimInjectXidRequest,
    StatsRequest,
    SubmitRequest,
    SuspendRequest,
    TaskRef,
    WaitRequest,
    encode_frame,
)
from gpusched.submittable import check_submittable
from gpusched_cli import messages, render, results
from gpusched_cli import submitspec as submit_cmd
from gpusched_cli.main import COMMANDS, cli
from gpusched_cli.options import UsageProblem

ENV = {"PATH": "/usr/bin:/bin", "HOME": "/home/u", "UNICODE": "caf\u00e9 \U0001f600"}


def _spec_pair(**kw: Any) -> tuple[dict[str, Any], JobSpec]:
    """The CLI's spec message and the JobSpec model made from the same flag values."""
    request_model: WholeRequest | MigRequest | ShareRequest = kw.pop("request_model")
    after: list[tuple[int, str]] = kw.pop("after_pairs", [])
    values = {"argv": ["python", "train.py", "--lr", "3e-4"], "cwd": "/work", "env": ENV, "name": None,
              "time_limit_s": None, "job_class": "batch", "nice": 0, "requeue": False, "precision": None,
              "cpus": None, "mem_mib": None, **kw}
    plain = messages.job_spec(request=_plain_request(request_model),
                              after=[messages.dependency(i, c) for i, c in after], **values)
    spec = JobSpec(request=request_model, after=[Dependency(job_id=i, condition=c) for i, c in after],  # type: ignore[arg-type]
                   **values)
    return plain, spec


def _plain_request(request: WholeRequest | MigRequest | ShareRequest) -> dict[str, Any]:
    if isinstance(request, WholeRequest):
        return messages.whole(request.gpus)
    if isinstance(request, MigRequest):
        return messages.mig(request.profile)
    return messages.share(request.fraction, request.gpu_mem_mib)


SPECS = [
    {"request_model": WholeRequest(gpus=2)},
    {"request_model": MigRequest(profile="3g.40gb"), "name": "eval", "time_limit_s": 5400,
     "job_class": "interactive", "nice": 3, "requeue": True, "precision": "bf16", "cpus": 8, "mem_mib": 32768,
     "after_pairs": [(12, "ok"), (13, "any")]},
    {"request_model": ShareRequest(fraction=0.25, gpu_mem_mib=10240), "env": {}},
    {"request_model": ShareRequest(fraction=1, gpu_mem_mib=1), "time_limit_s": 1},
]


@pytest.mark.parametrize("kw", SPECS)
@pytest.mark.parametrize("hold", [False, True])
def test_submit_frame_is_the_models_frame(kw: dict[str, Any], hold: bool) -> None:
    plain, spec = _spec_pair(**dict(kw))
    assert encode_frame(messages.submit(plain, hold)) == encode_frame(
        SubmitRequest(spec=spec, hold=hold).model_dump(mode="json"))


@pytest.mark.parametrize(("array", "request_id"), [(None, "0123abcd" * 4), ("1-10000%8", None), ("0,3,5-9:2", "k-1")])
def test_submit_frame_with_1_1_members_is_the_models_frame(array: str | None, request_id: str | None) -> None:
    """array and request_id are in the frame only when set, where the model puts them (after hold)."""
    plain, spec = _spec_pair(request_model=MigRequest(profile="3g.40gb"), name="eval", after_pairs=[(12, "ok")])
    frame = messages.submit(plain, True, array=array, request_id=request_id)
    assert encode_frame(frame) == encode_frame(
        SubmitRequest(spec=spec, hold=True, array=array, request_id=request_id).model_dump(mode="json"))
    assert ("array" in frame, "request_id" in frame) == (array is not None, request_id is not None)


FRAMES: list[tuple[dict[str, Any], BaseModel]] = [
    (messages.hello("1.0", "gpusched-cli"), HelloRequest(version="1.0", client="gpusched-cli")),
    (messages.queue(all_jobs=False, user=None, limit=1000, order="id"), QueueRequest()),
    (messages.queue(all_jobs=True, user="alice", limit=3, order="fairness"),
     QueueRequest(all=True, user="alice", limit=3, order="fairness")),
    (messages.queue(all_jobs=True, user=None, limit=50, order="id", array_tasks=True),
     QueueRequest(all=True, limit=50, array_tasks=True)),
    (messages.show(7), ShowRequest(job_id=7)),
    (messages.show(7, 0), ShowRequest(job_id=7, task=0)),
    (messages.show(120, 9999), ShowRequest(job_id=120, task=9999)),
    (messages.cancel([3, 1, 2]), CancelRequest(job_ids=[3, 1, 2])),
    (messages.cancel([3], [messages.task_ref(120, 7), messages.task_ref(120, 0)]),
     CancelRequest(job_ids=[3], tasks=[TaskRef(array_id=120, task=7), TaskRef(array_id=120, task=0)])),
    (messages.cancel([], [messages.task_ref(120, 7)]), CancelRequest(tasks=[TaskRef(array_id=120, task=7)])),
    (messages.job_control("suspend", [4]), SuspendRequest(job_ids=[4])),
    (messages.job_control("resume", [4, 5]), ResumeRequest(job_ids=[4, 5])),
    (messages.job_control("hold", [6]), HoldRequest(job_ids=[6])),
    (messages.job_control("release", [6]), ReleaseRequest(job_ids=[6])),
    (messages.job_control("hold", [], [messages.task_ref(120, 7)]), HoldRequest(tasks=[TaskRef(array_id=120, task=7)])),
    (messages.job_control("suspend", [4], [messages.task_ref(120, 0)]),
     SuspendRequest(job_ids=[4], tasks=[TaskRef(array_id=120, task=0)])),
    (messages.logs(9, 0, 0.0), LogsRequest(job_id=9, offset=0, wait_s=0.0)),
    (messages.logs(9, 4096, 10), LogsRequest(job_id=9, offset=4096, wait_s=10)),
    (messages.logs(120, 0, 10, task=0), LogsRequest(job_id=120, task=0, offset=0, wait_s=10)),
    (messages.wait(9, 30), WaitRequest(job_id=9, timeout_s=30)),
    (messages.wait(120, 30, task=7), WaitRequest(job_id=120, task=7, timeout_s=30)),
    (messages.gpu_drain("0", "fan"), GpuDrainRequest(device="0", reason="fan")),
    (messages.gpu_resume("MIG-1234"), GpuResumeRequest(device="MIG-1234")),
    (messages.mig_apply(1, ["3g.40gb", "2g.20gb"], True), MigApplyRequest(gpu=1, layout=["3g.40gb", "2g.20gb"],
                                                                         dry_run=True)),
    (messages.sim_inject_xid(0, 79, None, None, True), SimInjectXidRequest(gpu=0, xid=79, lost=True)),
    (messages.sim_inject_xid(1, 13, 2, 0, False), SimInjectXidRequest(gpu=1, xid=13, gi=2, ci=0)),
    (messages.stats(3600), StatsRequest(since_s=3600)),
    (messages.bare("gpus"), GpusRequest()),
    (messages.bare("doctor"), DoctorRequest()),
    (messages.bare("reload"), ReloadRequest()),
    (messages.bare("shutdown"), ShutdownRequest()),
]


@pytest.mark.parametrize(("plain", "request_model"), FRAMES, ids=lambda v: type(v).__name__)
def test_every_request_frame_is_the_models_frame(plain: dict[str, Any], request_model: BaseModel) -> None:
    assert encode_frame(plain) == encode_frame(request_model.model_dump(mode="json"))


def test_every_protocol_request_but_watch_has_a_builder() -> None:
    """A request added to the protocol gets a builder (and a row above) before the CLI can send it;
    `watch` is only sent by `top`, which uses the models."""
    sent = {frame["op"] for frame, _ in FRAMES} | {"submit"}
    assert sent == set(results_ops()) - {"watch"}


def results_ops() -> list[str]:
    from gpusched.protocol import RESULT_TYPES

    return list(RESULT_TYPES)


# ---- the limits the CLI checks before asking the model ----------------------------------------


def _max_length(field: Any) -> int:
    return int(next(m.max_length for m in field.metadata if getattr(m, "max_length", None) is not None))


def test_copied_limits_and_names_equal_the_models() -> None:
    assert submit_cmd.MAX_SPEC_BYTES == model.MAX_SPEC_BYTES
    assert submit_cmd.SPEC_STRING_OVERHEAD == model.SPEC_STRING_OVERHEAD
    assert _max_length(JobSpec.model_fields["name"]) == submit_cmd.MAX_NAME
    assert _max_length(JobSpec.model_fields["after"]) == submit_cmd.MAX_AFTER
    assert _max_length(MigRequest.model_fields["profile"]) == submit_cmd.MAX_PROFILE
    assert render.MAX_DISPLAY_NAME == model.MAX_DISPLAY_NAME
    assert {s.value for s in model.TERMINAL_STATES} == results.TERMINAL_STATES
    assert {s.value for s in model.WAITING_STATES} == results.WAITING_STATES


EDGES: list[dict[str, Any]] = [
    {"request_model": WholeRequest(gpus=1), "name": "n" * 128},
    {"request_model": WholeRequest(gpus=1), "name": "n" * 129},
    {"request_model": WholeRequest(gpus=1), "env": {"BIG": "x" * (model.MAX_SPEC_BYTES - 100)}},
    {"request_model": WholeRequest(gpus=1), "env": {"BIG": "x" * (model.MAX_SPEC_BYTES // 4 - 200)}},
    {"request_model": WholeRequest(gpus=1), "argv": ["true", "\U0001f600" * (model.MAX_SPEC_BYTES // 4)]},
    {"request_model": WholeRequest(gpus=1), "argv": ["true", *[""] * (model.MAX_SPEC_BYTES // 8)]},
    {"request_model": WholeRequest(gpus=1), "argv": ["a\x00b"]},
    {"request_model": WholeRequest(gpus=1), "after_pairs": [(i, "ok") for i in range(1, 66)]},
    {"request_model": WholeRequest(gpus=1), "after_pairs": [(i, "ok") for i in range(1, 65)]},
]


def _model_accepts(spec: dict[str, Any]) -> bool:
    """The model, and what a submit checks beyond it (gpusched.submittable)."""
    try:
        check_submittable(JobSpec.model_validate(spec))
    except ValueError:  # (ValidationError is one)
        return False
    return True


@pytest.mark.parametrize("kw", EDGES, ids=range(len(EDGES)))
def test_a_spec_the_model_refuses_is_never_sent_unchecked(kw: dict[str, Any]) -> None:
    plain = _plain_spec(kw)
    if _model_accepts(plain):
        submit_cmd.check_with_model(plain)  # and the full check, if the quick one asks for it, agrees
    else:
        assert submit_cmd.might_be_invalid(plain)
        with pytest.raises(UsageProblem):
            submit_cmd.check_with_model(plain)


def test_the_edges_are_on_both_sides_of_the_limits() -> None:
    verdicts = [_model_accepts(_plain_spec(kw)) for kw in EDGES]
    assert True in verdicts and verdicts.count(False) >= 5, verdicts


def _plain_spec(kw: dict[str, Any]) -> dict[str, Any]:
    kw = dict(kw)
    request = _plain_request(kw.pop("request_model"))
    after = [messages.dependency(i, c) for i, c in kw.pop("after_pairs", [])]
    values = {"argv": ["true"], "cwd": "/work", "env": ENV, "name": None, "time_limit_s": None, "job_class": "batch",
              "nice": 0, "requeue": False, "precision": None, "cpus": None, "mem_mib": None, **kw}
    return messages.job_spec(request=request, after=after, **values)


def test_a_usual_spec_does_not_pay_for_the_model() -> None:
    plain, _ = _spec_pair(request_model=WholeRequest(gpus=1), env={f"VAR{i}": "v" * 100 for i in range(200)})
    assert not submit_cmd.might_be_invalid(plain)


def test_a_long_mig_profile_is_checked_by_the_model() -> None:
    plain = _plain_spec({"request_model": WholeRequest(gpus=1)})
    plain["request"] = messages.mig("1" * 30 + "g.40gb")
    assert submit_cmd.might_be_invalid(plain)
    with pytest.raises(UsageProblem) as refused:  # named by the flag it came from
        submit_cmd.check_with_model(plain)
    assert refused.value.param_hint == "'--mig'" and "at most" in refused.value.message


# ---- render helpers that mirror the model's -----------------------------------------------------


@pytest.mark.parametrize("name", [None, "short", "n" * 64, "n" * 65, "\U0001f600" * 100])
@pytest.mark.parametrize("argv0", ["/usr/bin/python3", "p" * 300, "train"])
def test_display_name_is_the_models(name: str | None, argv0: str) -> None:
    spec = JobSpec(argv=[argv0], cwd="/", request=WholeRequest(gpus=1), name=name)
    assert render.display_name(spec.model_dump(mode="json")) == model.display_name(spec)


@pytest.mark.parametrize("request_model", [WholeRequest(gpus=3), MigRequest(profile="1g.10gb+me"),
                                           ShareRequest(fraction=0.125, gpu_mem_mib=5000)])
def test_describe_request_is_the_models(request_model: WholeRequest | MigRequest | ShareRequest) -> None:
    assert render.describe_request(request_model.model_dump(mode="json")) == model.describe_request(request_model)


# ---- lazy reading of results ---------------------------------------------------------------------


def test_a_malformed_result_is_explained_by_its_model() -> None:
    bad = {"already_finished": [3]}  # no "cancelled"
    with pytest.raises(ProtocolError) as info, results.reading("cancel", bad):
        render.cancel_text(bad)
    assert info.value.message.startswith("daemon sent a malformed result:") and "cancelled" in info.value.message


def test_a_bug_in_reading_a_valid_result_is_not_blamed_on_the_daemon() -> None:
    good = {"cancelled": [1], "already_finished": []}
    with pytest.raises(KeyError), results.reading("cancel", good):
        good["no such key"]


def test_an_array_named_in_hold_gets_a_line_and_its_tasks_a_run() -> None:
    text = render.changed_text("Held", {"changed": list(range(121, 221)), "unchanged": {}, "arrays": [120]})
    assert text.splitlines() == ["Array 120: its tasks that could be are held, the others are left as they are",
                                 "Held jobs 121-220"]


def test_unchanged_jobs_are_listed_in_id_order_from_json_keys() -> None:
    text = render.changed_text("Held", {"changed": [], "unchanged": {"10": "running", "9": "running"}})
    assert text.splitlines() == ["Job 9 unchanged: running", "Job 10 unchanged: running"]


# ---- the command table ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_registered_command_loads_under_its_name(name: str) -> None:
    command = cli.commands[name]
    assert isinstance(command, click.Command) and command.name == name
    assert cli.get_command(click.Context(cli), name) is command
