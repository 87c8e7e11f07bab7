"""Fuzzing the socket: whatever a local user sends, the daemon answers well or hangs up, and lives.

Hypothesis builds connections' worth of frames: random bytes, lying or over-limit lengths, cut-off
headers and bodies, JSON of the wrong shape, every request model with wrong-typed fields, huge
integers and deep nesting. For every example, against one live daemon:

- every answer is a well-formed response: `{"ok": true, "result": {...}}` (of the request's result
  type) or `{"ok": false, "error": {...}}` with a code from `protocol.ErrorCode`; or the daemon
  closes the connection (after an over-limit header, or when the client hung up mid-frame);
- every complete frame gets exactly one answer, in order;
- the daemon keeps serving: a normal client is answered after every example;
- a refused request changes nothing: `queue --all` is identical before and after.

Separate, targeted tests pin down inputs whose answers are well-formed but wrong (`internal` for
bad client input, or no answer at all); each such bug found was fixed, and its case stays here.
"""

from __future__ import annotations

import json
import socket
import struct
import typing
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from gpusched import protocol
from gpusched.model import MAX_SPEC_BYTES, JobSpec, WholeRequest
from gpusched.protocol import (
    MAX_FRAME,
    PROTOCOL_VERSION,
    RESULT_TYPES,
    ErrorCode,
    ErrorResponse,
    ProtocolError,
    QueueRequest,
    QueueResult,
    SubmitRequest,
    SubmitResult,
    encode_frame,
)
from tests.conftest import DaemonHandle, wait_until

MODELS: list[type[BaseModel]] = list(typing.get_args(typing.get_args(protocol.Request)[0]))
OPS = [m.model_fields["op"].default for m in MODELS]
# Valid requests the fuzzer may send for real: quick, and harmless to a test daemon. Anything else
# that happens to come out valid (shutdown, fault injection, MIG changes, a real submit, a 30 s
# long-poll) is filtered out of the examples.
HARMLESS = {"hello", "queue", "show", "gpus", "cancel", "hold", "release", "suspend", "resume", "logs", "wait"}
READ_ONLY = {"hello", "queue", "show", "gpus", "logs", "wait"}


# ---- strategies ----------------------------------------------------------------------------------

HUGE_INTS = st.one_of(
    st.integers(min_value=2**31 - 2, max_value=2**31 + 2),
    st.integers(min_value=2**63 - 2, max_value=2**64 + 2),
    st.integers(min_value=-(2**64), max_value=-(2**63) + 2),
    st.integers(min_value=10**30, max_value=10**300),
)
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-5, max_value=5), HUGE_INTS,
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=16),
    st.sampled_from(["", "0", "1.0", "whole", "mig", "share", "submit", "\x00", "\u2028", "../.."]),
)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                           max_size=4), max_leaves=16)


@st.composite
def spec_like(draw: st.DrawFn) -> Any:
    """A JobSpec-shaped object whose fields are sometimes right, sometimes wrong, sometimes missing."""
    good = JobSpec(argv=["true"], cwd="/tmp", request=WholeRequest(gpus=1)).model_dump(mode="json")
    out: dict[str, Any] = {}
    for name in JobSpec.model_fields:
        how = draw(st.sampled_from(["good", "wrong", "omit", "huge"]))
        if how == "good" and name in good:
            out[name] = good[name]
        elif how == "wrong":
            out[name] = draw(JSON)
        elif how == "huge":
            out[name] = draw(HUGE_INTS)
    if draw(st.booleans()):
        out["request"] = {"kind": draw(st.sampled_from(["whole", "mig", "share", "nope"])),
                          **draw(st.dictionaries(st.sampled_from(["gpus", "profile", "fraction", "gpu_mem_mib", "x"]),
                                                 JSON, max_size=3))}
    return out


@st.composite
def request_like(draw: st.DrawFn) -> dict[str, Any]:
    """One request model's shape, with each field right, wrong-typed, huge or missing, plus extras."""
    model = draw(st.sampled_from(MODELS))
    op: Any = model.model_fields["op"].default
    obj: dict[str, Any] = {"op": op if draw(st.integers(0, 9)) else draw(JSON)}
    for name in model.model_fields:
        if name == "op":
            continue
        how = draw(st.sampled_from(["small", "wrong", "omit", "huge", "list"]))
        if name == "spec":
            obj[name] = draw(spec_like()) if how != "omit" else None
        elif how == "small":
            obj[name] = draw(st.integers(min_value=-1, max_value=3))
        elif how == "wrong":
            obj[name] = draw(JSON)
        elif how == "huge":
            obj[name] = draw(HUGE_INTS)
        elif how == "list":
            obj[name] = draw(st.lists(st.one_of(st.integers(-1, 3), HUGE_INTS, JSON), max_size=5))
    if draw(st.integers(0, 4)) == 0:
        obj[draw(st.text(max_size=8))] = draw(JSON)
    return obj


SEEDS = st.integers(1, 2)  # the seed jobs (see seed_jobs); read them
ABSENT = st.integers(3, 9)  # ids no job has: mutating requests on them must be refused and change nothing
VALID_REQUESTS = st.one_of(
    st.builds(lambda all_, limit: {"op": "queue", "all": all_, "limit": limit}, st.booleans(), st.integers(1, 5)),
    st.builds(lambda i: {"op": "show", "job_id": i}, SEEDS | ABSENT),
    st.builds(lambda i, o: {"op": "logs", "job_id": i, "offset": o, "wait_s": 0}, SEEDS | ABSENT, st.integers(0, 99)),
    st.builds(lambda i: {"op": "wait", "job_id": i, "timeout_s": 0}, SEEDS | ABSENT),
    st.just({"op": "gpus"}),
    st.builds(lambda op, ids: {"op": op, "job_ids": ids},
              st.sampled_from(["cancel", "hold", "release", "suspend", "resume"]), st.lists(ABSENT, min_size=1)),
)


def _valid(body: bytes) -> BaseModel | None:
    """The request `body` holds, if it is a valid one (what the daemon must then answer with)."""
    if body.count(b"[") + body.count(b"{") > 100:
        # No valid request nests that deep; and a RecursionError in this thread would upset CPython
        # 3.11's ast module (pytest's report then dies with "AST constructor recursion depth mismatch").
        return None
    try:
        return protocol.parse_request(protocol.decode_body(body))
    except Exception:
        return None


def _harmless(body: bytes) -> bool:
    request = _valid(body)
    if request is None:
        return True
    op = getattr(request, "op", "")
    return op in HARMLESS and getattr(request, "wait_s", 0) <= 0.5 and getattr(request, "timeout_s", 0) <= 0.5


def _dump(obj: Any) -> bytes:
    return json.dumps(obj, allow_nan=True).encode()


DEEP = st.sampled_from([10, 500, 1000, 3000, 20000, 60000])
BODIES = st.one_of(
    st.binary(min_size=1, max_size=512),
    st.text(max_size=200).map(str.encode).filter(bool),
    JSON.map(_dump),
    request_like().map(_dump),
    VALID_REQUESTS.map(_dump),
    st.builds(lambda n, op: f'{{"op":"{op}","job_id":{"9" * n}}}'.encode(),
              st.sampled_from([19, 20, 400, 4300, 4301, 20000]), st.sampled_from(OPS)),
    st.builds(lambda n: b"[" * n + b"]" * n, DEEP),
    st.builds(lambda n: ('{"op":"queue","user":' + "[" * n + "]" * n + "}").encode(), DEEP),
    st.builds(lambda n: ('{"a":' * n + "1" + "}" * n).encode(), DEEP),
).filter(_harmless)


@st.composite
def frame(draw: st.DrawFn) -> tuple[bytes, str]:
    """(bytes on the wire, kind); only an "ok" frame is one complete frame owed exactly one answer."""
    body = draw(BODIES)
    kind = draw(st.sampled_from(["ok"] * 6 + ["short", "long", "zero", "over"]))
    if kind == "ok":
        return struct.pack(">I", len(body)) + body, kind
    if kind == "short":  # announces more than is sent: the client then hangs up mid-body
        return struct.pack(">I", len(body) + draw(st.integers(1, 1000))) + body, kind
    if kind == "long":  # announces less than is sent: the rest is read as further frames
        cut = draw(st.integers(0, max(0, len(body) - 1)))
        return struct.pack(">I", cut) + body, kind
    if kind == "zero":
        return struct.pack(">I", 0), kind
    return struct.pack(">I", draw(st.integers(MAX_FRAME + 1, 2**32 - 1))) + body[:64], kind


CONNECTIONS = st.tuples(
    st.booleans(),  # say hello first
    st.lists(frame(), min_size=1, max_size=4),
    st.one_of(st.just(b""), st.binary(min_size=1, max_size=3)),  # a cut-off header at the end
)


# ---- talking to the daemon -----------------------------------------------------------------------


def _recv_exact(s: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = s.recv(n - len(buf))
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return None if not buf else bytes(buf)
        buf += chunk
    return bytes(buf)


def read_replies(s: socket.socket) -> list[Any]:
    """Every frame until the daemon closes the connection; a half frame is a protocol violation."""
    replies: list[Any] = []
    while True:
        header = _recv_exact(s, 4)
        if header is None:
            return replies
        assert len(header) == 4, f"daemon sent a partial header {header!r}"
        length = struct.unpack(">I", header)[0]
        assert 0 < length <= MAX_FRAME, f"daemon sent a frame of {length} bytes"
        body = _recv_exact(s, length)
        assert body is not None and len(body) == length, "daemon sent a truncated frame"
        replies.append(json.loads(body))


def check_response(reply: Any, request: BaseModel | None) -> None:
    assert isinstance(reply, dict), reply
    if reply.get("ok") is True:
        assert set(reply) == {"ok", "result"} and isinstance(reply["result"], dict), reply
        if request is not None:
            RESULT_TYPES[request.op].model_validate(reply["result"])  # type: ignore[attr-defined]
    else:
        parsed = ErrorResponse.model_validate(reply)  # ok: false, a known code, a message, a hint
        assert parsed.error.code in set(ErrorCode) and parsed.error.message, reply


def store_snapshot(d: DaemonHandle) -> list[dict[str, Any]]:
    with d.client() as c:
        return [row.model_dump() for row in c.call(QueueRequest(all=True, after_id=0, limit=3000), QueueResult).jobs]


def seed_jobs(d: DaemonHandle) -> list[int]:
    """A running job and a held one, so ids 1 and 2 exist for the fuzzer's requests to hit."""
    with d.client() as c:
        running = c.call(SubmitRequest(spec=JobSpec(argv=["sleep", "600"], cwd="/tmp",
                                                    request=WholeRequest(gpus=1))), SubmitResult).job_id
        held = c.call(SubmitRequest(spec=JobSpec(argv=["true"], cwd="/tmp", request=WholeRequest(gpus=1)),
                                    hold=True), SubmitResult).job_id
        wait_until(lambda: next(r for r in c.call(QueueRequest(), QueueResult).jobs if r.id == running).state
                   == "RUNNING", what="seed job running")
    return [running, held]


# ---- the property --------------------------------------------------------------------------------


def test_any_bytes_get_a_well_formed_answer_and_change_nothing(daemon_factory: Callable[..., DaemonHandle]) -> None:
    d = daemon_factory()
    seed_jobs(d)
    stats: dict[str, int] = {"examples": 0, "replies": 0}

    @settings(max_examples=200, deadline=None, database=None, derandomize=False,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
    @given(CONNECTIONS)
    def example(connection: tuple[bool, list[tuple[bytes, str]], bytes]) -> None:
        greet, frames, tail = connection
        before = store_snapshot(d)
        expected: list[BaseModel | None] = []  # the request each answer belongs to (None: not a valid one)
        stream, broken = b"", ""
        for wire, kind in frames:
            stream += wire
            if kind != "ok":
                broken = kind  # after a lying or over-limit header the rest has no known framing
                break
            expected.append(_valid(wire[4:]))
        else:
            stream += tail
            broken = "tail" if tail else ""
        mutating = any(r is not None and getattr(r, "op", "") not in READ_ONLY for r in expected)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(15)
            s.connect(d.socket)
            if greet:
                s.sendall(encode_frame({"op": "hello", "version": PROTOCOL_VERSION}))
            try:
                s.sendall(stream)
                s.shutdown(socket.SHUT_WR)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the daemon hung up first (over-limit header): allowed
            replies = read_replies(s)
        if greet:
            assert replies, "no answer to hello"
            hello = replies.pop(0)
            assert hello.get("ok") is True, hello
        # Complete frames are answered one for one, in order. After them: a body cut short gets no
        # answer; a zero, over-limit or cut-off header gets one error and the connection closes; a
        # header announcing less than was sent makes the rest read as more frames (any number).
        assert len(replies) >= len(expected), f"{len(expected)} complete frames, only {len(replies)} answers"
        extra = len(replies) - len(expected)
        assert broken == "long" or extra <= {"": 0, "short": 0, "zero": 1, "over": 1, "tail": 1}[broken], \
            (broken, replies)
        for i, reply in enumerate(replies):
            check_response(reply, expected[i] if i < len(expected) else None)
            if i >= len(expected):
                assert reply.get("ok") is False, reply
        stats["examples"] += 1
        stats["replies"] += len(replies)
        for reply in replies:
            code = "ok" if reply.get("ok") is True else reply["error"]["code"]
            stats[code] = stats.get(code, 0) + 1
        # The daemon still serves everyone else, and refused requests left the store as it was.
        after = store_snapshot(d)
        if not mutating:
            assert after == before

    example()
    print(f"\nfuzz: {stats.pop('examples')} connections, {stats.pop('replies')} answers checked: {stats}")


def test_frames_at_the_size_limit(daemon: DaemonHandle) -> None:
    """Exactly MAX_FRAME is read and answered (and the stream stays usable); one byte more closes it."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(daemon.socket)
        s.sendall(encode_frame({"op": "hello", "version": PROTOCOL_VERSION}))
        body = b" " * (MAX_FRAME - 2) + b"{}"
        s.sendall(struct.pack(">I", len(body)) + body + encode_frame({"op": "gpus"}))
        s.shutdown(socket.SHUT_WR)
        _hello, big, gpus = read_replies(s)
    assert big["error"]["code"] == "bad_request"  # a JSON object, but not a request: the frame was read
    assert gpus["ok"] is True
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(daemon.socket)
        s.sendall(struct.pack(">I", MAX_FRAME + 1) + b"x" * 1000)
        [reply] = read_replies(s)
    assert reply["error"]["code"] == "bad_frame" and str(MAX_FRAME) in reply["error"]["message"]


# ---- inputs that get a well-formed but wrong answer (bugs) ---------------------------------------

BAD_INPUT_CODES = {ErrorCode.BAD_FRAME, ErrorCode.BAD_REQUEST, ErrorCode.NOT_FOUND}


@pytest.mark.parametrize("body", [
    pytest.param(b'{"op":"show","job_id":1' + b"0" * 4400 + b"}", id="int-over-4300-digits"),
    pytest.param(b"[" * 50_000 + b"]" * 50_000, id="deeply-nested"),
    pytest.param(b'{"op":"show","job_id":100000000000000000000}', id="job-id-over-int64"),
    pytest.param(b'{"op":"cancel","job_ids":[1, 100000000000000000000]}', id="job-ids-over-int64"),
    pytest.param(b'{"op":"logs","job_id":1,"offset":100000000000000000000}', id="log-offset-over-int64"),
    pytest.param(b"{\"op\":\"show\",\"job_id\":9223372036854775807}", id="job-id-int64-max"),
    pytest.param(b'{"op":"logs","job_id":1,"offset":4611686018427387904}', id="log-offset-2**62"),
    pytest.param(b'{"op":"logs","job_id":1,"offset":1099511627776}', id="log-offset-1TiB"),
])
def test_bad_client_input_is_never_an_internal_error(daemon: DaemonHandle, body: bytes) -> None:
    """Client input is refused as bad_frame / bad_request / not_found, never `internal` (a daemon bug)."""
    seed_jobs(daemon)
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(daemon.socket)
        s.sendall(encode_frame({"op": "hello", "version": PROTOCOL_VERSION}))
        s.sendall(struct.pack(">I", len(body)) + body + encode_frame({"op": "gpus"}))
        s.shutdown(socket.SHUT_WR)
        _hello, reply, after = read_replies(s)
    assert after["ok"] is True  # the connection stays usable either way
    if reply["ok"] is False:
        assert ErrorCode(reply["error"]["code"]) in BAD_INPUT_CODES, reply


def test_a_spec_too_big_to_show_is_refused_and_a_big_one_still_shows(daemon: DaemonHandle) -> None:
    """A job's `show`/`wait` reply must always fit in one frame: huge specs are refused at submit."""
    huge = {"op": "submit", "spec": {"argv": ["true"], "cwd": "/tmp", "env": {"BIG": "x" * (MAX_FRAME - 300)},
                                     "request": {"kind": "whole", "gpus": 1}}}
    with daemon.client() as c:
        reply = c.raw_call(huge)
        assert reply["ok"] is False and reply["error"]["code"] == "bad_request"
        assert f"at most {MAX_SPEC_BYTES} are accepted" in reply["error"]["message"]
        spec = JobSpec(argv=["true"], cwd="/tmp",  # (each variable under what execve takes: 128 KiB)
                       env={"BIG": "x" * 100_000, "BIG2": "x" * 100_000, "BIG3": "x" * (MAX_SPEC_BYTES - 200_100)},
                       request=WholeRequest(gpus=1))
        job_id = c.call(SubmitRequest(spec=spec, hold=True), SubmitResult).job_id
    for request in ({"op": "show", "job_id": job_id}, {"op": "wait", "job_id": job_id, "timeout_s": 0}):
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(daemon.socket)
            s.sendall(encode_frame({"op": "hello", "version": PROTOCOL_VERSION}) + encode_frame(request))
            s.shutdown(socket.SHUT_WR)
            replies = read_replies(s)
        assert len(replies) == 2, f"{request['op']}: no answer, the connection was closed"
        check_response(replies[1], None)


def test_encode_frame_refuses_what_the_peer_would_refuse() -> None:
    with pytest.raises(ProtocolError):
        encode_frame({"x": "y" * MAX_FRAME})
