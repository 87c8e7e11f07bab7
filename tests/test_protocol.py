"""The wire format on its own: frames, limits, request validation, version check."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel

from gpusched.model import Dependency, JobSpec, JobState, MigRequest, ShareRequest, WholeRequest
from gpusched.protocol import (
    HEADER,
    MAX_FRAME,
    PROTOCOL_VERSION,
    REQUEST_ADAPTER,
    RESULT_TYPES,
    CancelRequest,
    DoctorRequest,
    ErrorCode,
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
    SubmitResult,
    SuspendRequest,
    WaitRequest,
    WatchRequest,
    check_version,
    decode_body,
    encode_frame,
    error,
    frame_length,
    ok,
    ok_body,
    parse_frame,
    parse_request,
)


def _decode_frame(frame: bytes) -> dict[str, Any]:
    length = frame_length(frame[: HEADER.size])
    assert len(frame) == HEADER.size + length
    return decode_body(frame[HEADER.size :])


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@given(st.dictionaries(st.text(), json_values, max_size=6))
def test_frames_round_trip(obj: dict[str, Any]) -> None:
    assert _decode_frame(encode_frame(obj)) == obj


def test_header_is_four_byte_big_endian_length() -> None:
    frame = encode_frame({"op": "gpus"})
    assert frame[:4] == (len(frame) - 4).to_bytes(4, "big")
    assert frame[4:] == b'{"op":"gpus"}'


def test_non_ascii_is_sent_as_utf8() -> None:
    frame = encode_frame({"name": "zürich-训练"})
    assert "zürich-训练".encode() in frame


def test_oversize_frames_are_refused_both_ways() -> None:
    with pytest.raises(ProtocolError) as exc:
        encode_frame({"data": "x" * MAX_FRAME})
    assert exc.value.code is ErrorCode.BAD_FRAME
    assert str(MAX_FRAME) in exc.value.message
    with pytest.raises(ProtocolError) as exc:
        frame_length(HEADER.pack(MAX_FRAME + 1))
    assert exc.value.code is ErrorCode.BAD_FRAME
    assert frame_length(HEADER.pack(MAX_FRAME)) == MAX_FRAME  # the limit itself is allowed


def test_largest_body_that_fits_is_accepted() -> None:
    overhead = len(json.dumps({"d": ""}, separators=(",", ":")))
    frame = encode_frame({"d": "x" * (MAX_FRAME - overhead)})
    assert len(frame) == HEADER.size + MAX_FRAME


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"\xff\xfe", "UTF-8"),
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "JSON object, not list"),
        (b'"op"', "JSON object, not str"),
    ],
)
def test_bad_bodies_say_what_is_wrong(body: bytes, needle: str) -> None:
    with pytest.raises(ProtocolError) as exc:
        decode_body(body)
    assert exc.value.code is ErrorCode.BAD_FRAME
    assert needle in exc.value.message


def test_empty_frame_is_refused() -> None:
    with pytest.raises(ProtocolError, match="empty frame"):
        frame_length(HEADER.pack(0))


SPEC = JobSpec(argv=["python", "train.py"], cwd="/home/alice", env={"PATH": "/bin"}, request=WholeRequest(gpus=2),
               name="train", time_limit_s=600, job_class="interactive", nice=5, requeue=True, precision="bf16",
               after=[Dependency(job_id=1), Dependency(job_id=2, condition="any")], cpus=8, mem_mib=4096)
EVERY_REQUEST: list[BaseModel] = [
    HelloRequest(version=PROTOCOL_VERSION, client="test"),
    SubmitRequest(spec=SPEC),
    SubmitRequest(spec=SPEC, hold=True),
    SubmitRequest(spec=SPEC.model_copy(update={"request": MigRequest(profile="1g.10gb+me")})),
    SubmitRequest(spec=SPEC.model_copy(update={"request": ShareRequest(fraction=0.25, gpu_mem_mib=10240)})),
    QueueRequest(all=True, user="alice", limit=5),
    ShowRequest(job_id=3),
    CancelRequest(job_ids=[1, 2, 3]),
    LogsRequest(job_id=3, offset=10, max_bytes=100, wait_s=2.5),
    WaitRequest(job_id=3, timeout_s=1.0),
    SuspendRequest(job_ids=[3]),
    ResumeRequest(job_ids=[3, 4]),
    HoldRequest(job_ids=[5]),
    ReleaseRequest(job_ids=[5]),
    GpuDrainRequest(device="0", reason="maintenance"),
    GpuResumeRequest(device="MIG-1d2c3b4a-5e6f-4a7b-8c9d-0e1f2a3b4c5d"),
    MigApplyRequest(gpu=1, layout=["3g.40gb", "2g.20gb"], dry_run=True),
    SimInjectXidRequest(gpu=0, xid=94, gi=1, ci=0),
    DoctorRequest(),
    ReloadRequest(),
    StatsRequest(since_s=600),
    WatchRequest(max_rate_hz=2, max_pending=10),
    GpusRequest(),
    ShutdownRequest(),
]


def test_every_op_has_a_round_trip_case() -> None:
    assert {r.op for r in EVERY_REQUEST} == set(RESULT_TYPES)  # type: ignore[attr-defined]


@pytest.mark.parametrize("request_model", EVERY_REQUEST, ids=lambda r: r.op)
def test_every_request_round_trips_through_a_frame(request_model: BaseModel) -> None:
    wire = _decode_frame(encode_frame(request_model.model_dump(mode="json")))
    assert parse_request(wire) == request_model
    assert REQUEST_ADAPTER.dump_python(parse_request(wire), mode="json") == request_model.model_dump(mode="json")


@pytest.mark.parametrize(
    ("obj", "needle"),
    [
        ({"op": "frobnicate"}, "op"),
        ({}, "op"),
        ({"op": "show"}, "job_id"),
        ({"op": "show", "job_id": 0}, "job_id"),
        ({"op": "queue", "bogus": 1}, "bogus"),
        ({"op": "cancel", "job_ids": []}, "job_ids"),
        ({"op": "logs", "job_id": 1, "wait_s": 31}, "wait_s"),
        ({"op": "submit", "spec": {"argv": ["x"], "cwd": "/", "request": {"kind": "whole", "gpus": 0}}},
         "spec.request.gpus"),
        ({"op": "submit", "spec": {"argv": ["x"], "cwd": "rel", "request": {"kind": "whole", "gpus": 1}}},
         "spec.cwd"),
    ],
)
def test_bad_requests_name_the_field(obj: dict[str, Any], needle: str) -> None:
    with pytest.raises(ProtocolError) as exc:
        parse_request(obj)
    assert exc.value.code is ErrorCode.BAD_REQUEST
    assert needle in exc.value.message


def test_version_check_names_both_versions() -> None:
    check_version(PROTOCOL_VERSION)
    major = PROTOCOL_VERSION.split(".")[0]
    check_version(f"{major}.99")  # minor versions are compatible
    theirs = f"{int(major) + 1}.0"
    with pytest.raises(ProtocolError) as exc:
        check_version(theirs)
    assert exc.value.code is ErrorCode.VERSION_MISMATCH
    assert PROTOCOL_VERSION in exc.value.message and theirs in exc.value.message
    assert exc.value.hint


def test_error_envelope_shape() -> None:
    assert error(ErrorCode.NOT_FOUND, "no job 9", "h") == {
        "ok": False, "error": {"code": "not_found", "message": "no job 9", "hint": "h"},
    }


def test_members_added_in_1_1_are_left_out_while_unset() -> None:
    """A 1.0 peer refuses unknown members: what does not use arrays or request_id must look as in 1.0."""
    from gpusched.model import Job, JobSpec, JobState, WholeRequest
    from gpusched.protocol import CancelRequest, CancelResult, QueueResult, ShowRequest, SubmitRequest, SubmitResult

    spec = JobSpec(argv=["true"], cwd="/tmp", request=WholeRequest(gpus=1))
    assert set(SubmitRequest(spec=spec).model_dump(mode="json")) == {"op", "spec", "hold"}
    assert SubmitResult(job_id=1, state=JobState.PENDING).model_dump(mode="json") == {"job_id": 1, "state": "PENDING"}
    assert set(ShowRequest(job_id=1).model_dump(mode="json")) == {"op", "job_id"}
    assert set(CancelRequest(job_ids=[1]).model_dump(mode="json")) == {"op", "job_ids"}
    assert set(CancelResult(cancelled=[1]).model_dump(mode="json")) == {"cancelled", "already_finished"}
    assert set(QueueResult(jobs=[]).model_dump(mode="json")) == {"jobs", "total"}
    job = Job(id=1, uid=0, gid=0, user="root", spec=spec, state=JobState.PENDING, submitted_at=0.0)
    assert "array_id" not in job.model_dump(mode="json") and "array_task" not in job.model_dump(mode="json")
    task = job.model_copy(update={"array_id": 5, "array_task": 0})
    assert (task.model_dump(mode="json")["array_id"], task.model_dump(mode="json")["array_task"]) == (5, 0)


def _parsed_the_long_way(body: bytes) -> object:
    try:
        return parse_request(decode_body(body))
    except ProtocolError as exc:
        return (exc.code, exc.message, exc.hint)


def _parsed(body: bytes) -> object:
    try:
        return parse_frame(body)
    except ProtocolError as exc:
        return (exc.code, exc.message, exc.hint)


_SUBMIT = b'{"op":"submit","spec":{"argv":["a"],"cwd":"/tmp","env":{},%s"request":{"kind":"whole","gpus":1}}}'


@pytest.mark.parametrize("body", [
    *(encode_frame(r.model_dump(mode="json"))[HEADER.size:] for r in EVERY_REQUEST),
    _SUBMIT % b'"argv":["b"],',  # a key twice: the last one counts
    b'{"op":"hello","op":"submit","spec":{"argv":["a"],"cwd":"/tmp","env":{},"request":{"kind":"whole","gpus":1}}}',
    _SUBMIT % b'"time_limit_s":NaN,', _SUBMIT % b'"time_limit_s":1e400,', _SUBMIT % b'"time_limit_s":"60",',
    _SUBMIT % (b'"time_limit_s":' + b"9" * 400 + b","),  # an integer past the largest float: refused both ways
    _SUBMIT.replace(b'["a"]', b'["\\ud800"]'),  # a lone surrogate: JSON allows it, pydantic's reader does not
    _SUBMIT.replace(b'"gpus":1', b'"gpus":1.0'), _SUBMIT.replace(b'"gpus":1', b'"gpus":"1"'),
    b' {"op":"hello","version":"1.0"} ', b'\xef\xbb\xbf{"op":"hello","version":"1.0"}', b"\xff\xfe", b"{not json",
    b"[1, 2]", b'"op"', b'{"op":"frobnicate"}', b'{"op":"submit","spec":' + b"[" * 5000 + b"]" * 5000 + b"}",
])
def test_a_frame_is_parsed_in_one_step_exactly_as_the_long_way(body: bytes) -> None:
    """parse_frame lets pydantic read the JSON; what it accepts and every error must be as before."""
    assert _parsed(body) == _parsed_the_long_way(body)


@given(json_values)
def test_any_json_is_parsed_in_one_step_exactly_as_the_long_way(value: Any) -> None:
    body = json.dumps({"op": "submit", "spec": value}).encode()
    assert _parsed(body) == _parsed_the_long_way(body)


@pytest.mark.parametrize("result", [
    SubmitResult(job_id=7, state=JobState.PENDING),
    SubmitResult(job_id=8, state=JobState.HELD, tasks=1000, duplicate=True),
    SubmitResult(job_id=9, state=JobState.PENDING, duplicate=True),
])
def test_an_answer_serialised_in_one_step_is_the_same_bytes(result: BaseModel) -> None:
    body = ok_body(result)
    assert body is not None and body == encode_frame(ok(result))[HEADER.size:]


def test_only_the_submit_answer_is_serialised_in_one_step() -> None:
    """ok_body writes a SubmitResult by hand (tests/test_submit_checks.py); the others take the general path."""
    assert ok_body(RESULT_TYPES["show"].model_construct()) is None


@pytest.mark.parametrize("limit", [b"1e400", b"9" * 400, b"Infinity"])
def test_a_time_limit_must_be_finite(limit: bytes) -> None:
    """An infinite limit would be stored as null (no limit at all) after a restart: refused."""
    with pytest.raises(ProtocolError) as exc:
        parse_frame(_SUBMIT % (b'"time_limit_s":' + limit + b","))
    assert exc.value.code is ErrorCode.BAD_REQUEST and "spec.time_limit_s" in exc.value.message
