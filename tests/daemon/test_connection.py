"""The server's connection protocol (connection.py): frames cut out of whatever chunks the kernel
hands over, in order; reading paused while a client's unanswered bytes pile up; writes drained."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpusched.daemon import connection
from gpusched.daemon.connection import Connection
from gpusched.wire import MAX_FRAME, PROTOCOL_VERSION, ProtocolError, decode_body, encode_frame
from tests.conftest import DaemonHandle


class _Transport:
    """What the protocol asks of its transport, recorded."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.paused = False
        self.pauses = 0
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def pause_reading(self) -> None:
        assert not self.paused, "paused twice"
        self.paused = True
        self.pauses += 1

    def resume_reading(self) -> None:
        assert self.paused, "resumed while reading"
        self.paused = False

    def get_extra_info(self, name: str) -> None:
        return None

    def close(self) -> None:
        self.closed = True


async def _idle(conn: Connection) -> None:
    """A session that reads nothing: the test takes the frames itself."""


def _connected() -> tuple[Connection, _Transport]:
    conn = Connection(_idle)
    transport = _Transport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    return conn, transport


def _frames(n: int) -> list[bytes]:
    return [encode_frame({"op": "show", "job_id": i, "pad": "x" * (i * 7 % 50)}) for i in range(n)]


@settings(max_examples=60, deadline=None)
@given(count=st.integers(1, 8), cuts=st.lists(st.integers(1, 2000), max_size=30))
def test_frames_come_out_whole_and_in_order_however_the_bytes_are_cut(count: int, cuts: list[int]) -> None:
    async def scenario() -> None:
        conn, _ = _connected()
        frames = _frames(count)
        stream = b"".join(frames)
        chunks, at = [], 0
        for cut in cuts:
            chunks.append(stream[at : at + cut])
            at += cut
        chunks.append(stream[at:])
        taken: list[bytes] = []
        for chunk in chunks:
            if chunk:
                conn.data_received(chunk)
            while (body := conn.take_frame()) is not None:
                taken.append(body)
        assert taken == [frame[4:] for frame in frames]
        assert conn.buffered == 0 and conn.take_frame() is None

    asyncio.run(scenario())


def test_a_header_over_the_limit_is_refused_before_its_body_comes() -> None:
    async def scenario() -> None:
        conn, _ = _connected()
        conn.data_received(struct.pack(">I", MAX_FRAME + 1))
        with pytest.raises(ProtocolError, match="exceeds"):
            conn.take_frame()

    asyncio.run(scenario())


def test_reading_pauses_while_unanswered_bytes_pile_up_and_resumes_once_they_are_taken() -> None:
    async def scenario() -> None:
        conn, transport = _connected()
        frame = encode_frame({"op": "gpus", "pad": "x" * 4000})
        sent = 0
        while not transport.paused:
            conn.data_received(frame)
            sent += 1
            assert sent * len(frame) < 2 * connection._HIGH_WATER, "never paused"
        assert conn.buffered > connection._HIGH_WATER
        taken = 0
        while transport.paused:
            assert conn.take_frame() is not None
            taken += 1
        assert conn.buffered <= connection._HIGH_WATER and transport.pauses == 1
        while conn.take_frame() is not None:
            taken += 1
        assert taken == sent

    asyncio.run(scenario())


def test_a_frame_larger_than_the_high_water_mark_is_still_read_whole() -> None:
    """Pausing counts only bytes beyond the frame being assembled: a big frame must not stall itself."""
    async def scenario() -> None:
        conn, transport = _connected()
        big = encode_frame({"op": "gpus", "pad": "x" * (6 * connection._HIGH_WATER)})
        chunk = 2 * connection._HIGH_WATER  # as uvloop hands them over: 256 KiB at a time
        body = None
        for at in range(0, len(big), chunk):
            # The first chunk may pause reading (the frame's size is not known yet): the session's
            # next look at it, which learns the size, must let the rest in.
            conn.data_received(big[at : at + chunk])
            body = conn.take_frame()
            assert body is None or at + chunk >= len(big)
            assert not transport.paused, f"paused after {at + chunk} of {len(big)} bytes of one frame"
        assert body == big[4:] and conn.buffered == 0

    asyncio.run(scenario())


def test_wait_returns_at_the_end_of_file_and_at_a_lost_connection() -> None:
    async def scenario() -> None:
        conn, _ = _connected()
        waiting = asyncio.ensure_future(conn.wait())
        await asyncio.sleep(0)
        assert not waiting.done()
        conn.data_received(b"\x00")
        await waiting
        assert not conn.at_eof
        waiting = asyncio.ensure_future(conn.wait())
        await asyncio.sleep(0)
        assert conn.eof_received() is True  # half-closed: what came before the end of file is answered
        await waiting
        assert conn.at_eof and conn.take_frame() is None
        await conn.wait()  # at once, from now on
        conn.connection_lost(None)
        await conn.closed
        with pytest.raises(ConnectionResetError):
            await conn.drain()

    asyncio.run(scenario())


def test_drain_waits_while_the_transport_is_over_its_high_water_mark() -> None:
    async def scenario() -> None:
        conn, _ = _connected()
        await conn.drain()  # not paused: at once
        conn.pause_writing()
        draining = asyncio.ensure_future(conn.drain())
        await asyncio.sleep(0)
        assert not draining.done()
        conn.resume_writing()
        await draining

    asyncio.run(scenario())


def test_a_client_that_floods_requests_without_reading_answers_does_not_stall_the_daemon(
        daemon: DaemonHandle) -> None:
    """Frames pipelined faster than they are answered, answers never read: the daemon stops reading
    that socket (its memory bounded by the high-water marks) and serves everyone else; once the
    client reads, every request it sent is answered, in order."""
    requests = 4000
    frame = encode_frame({"op": "show", "job_id": 1 << 40, "pad": "x" * 2000})  # refused: an answer all the same
    sender_done = threading.Event()
    with socket.socket(socket.AF_UNIX) as flood:
        flood.settimeout(60)
        flood.connect(daemon.socket)
        flood.sendall(encode_frame({"op": "hello", "version": PROTOCOL_VERSION}))

        def send_all() -> None:
            try:
                flood.sendall(frame * requests)
            finally:
                sender_done.set()

        sender = threading.Thread(target=send_all, daemon=True)
        sender.start()
        assert not sender_done.wait(2), "8 MB of requests were all taken without a single answer read"
        with daemon.client() as c:  # the daemon goes on serving another client meanwhile
            assert c.raw_call({"op": "gpus"})["ok"] is True
        replies: list[dict[str, object]] = []
        buffer = b""
        while len(replies) < requests + 1:  # the hello's answer, then one per request
            chunk = flood.recv(1 << 20)
            assert chunk, f"the daemon closed the connection after {len(replies)} answers"
            buffer += chunk
            while len(buffer) >= 4 and len(buffer) >= 4 + (size := struct.unpack(">I", buffer[:4])[0]):
                replies.append(decode_body(buffer[4 : 4 + size]))
                buffer = buffer[4 + size :]
        sender.join(60)
        assert sender_done.is_set()
    assert replies[0]["ok"] is True
    assert all(r["ok"] is False and r["error"]["code"] == "bad_request" for r in replies[1:]), replies[1]  # type: ignore[index]


def test_the_daemon_stops_in_time_while_a_client_reads_none_of_its_answers(daemon: DaemonHandle) -> None:
    """Closing a connection waits for the kernel to take the answers already written; a client that
    reads none of them must not hold the daemon's shutdown (its connection is dropped instead)."""
    frame = encode_frame({"op": "show", "job_id": 1 << 40, "pad": "x" * 2000})
    with socket.socket(socket.AF_UNIX) as stuck:
        stuck.connect(daemon.socket)
        stuck.sendall(encode_frame({"op": "hello", "version": PROTOCOL_VERSION}))
        stuck.settimeout(2)
        with contextlib.suppress(TimeoutError):  # until the daemon stops reading this socket
            while True:
                stuck.sendall(frame * 64)
        began = time.monotonic()
        daemon.stop()  # asserts it stopped within 30 s
        assert time.monotonic() - began < 20
