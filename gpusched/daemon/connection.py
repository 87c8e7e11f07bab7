"""One client connection as the server reads and writes it: whole frames in, frames out.

The server used asyncio's streams: a StreamReader fed by its protocol, three `readexactly` per
request (the first byte, the rest of the header, the body), a StreamWriter around the transport.
At thousands of submits a second that plumbing was about an eighth of the Python lines the daemon
ran per submit (feed_data, _wakeup_waiter, readexactly, _wait_for_data, _maybe_resume_transport).
Here the protocol keeps the bytes itself and the session takes a whole frame in one call; it waits
only when the bytes are not there yet, which, for a client that sends a request and waits for its
answer, is once per request.

Flow control is the streams' own, by hand: reading pauses while more than `_HIGH_WATER` bytes wait
beyond the frame being assembled (a client that pipelines requests faster than they are answered
holds that much of the daemon's memory, no more), and `drain` waits while the transport's write
buffer is over its high-water mark.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from gpusched.wire import HEADER, frame_length

_HIGH_WATER = 64 * 1024  # bytes buffered beyond the frame in hand before reading pauses (the streams' too)


class Connection(asyncio.Protocol):
    """The daemon's side of one client socket; `serve` (the server's coroutine) runs as its task."""

    def __init__(self, serve: Callable[[Connection], Coroutine[Any, Any, None]]) -> None:
        self._serve = serve  # started as the connection's task once the transport is up
        self.transport: asyncio.Transport | None = None
        self._buffer = b""
        self._taken = 0  # bytes of _buffer already taken: frames are cut from it without copying the rest
        self._need = HEADER.size  # bytes the frame being assembled needs in all, once its header came
        self._eof = False
        self._waiter: asyncio.Future[None] | None = None
        self._reading_paused = False
        self._writing_paused: asyncio.Future[None] | None = None
        self._lost = False
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.task: asyncio.Task[None] | None = None

    # ---- the transport's side --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a Unix stream socket's transport
        self.task = asyncio.get_running_loop().create_task(self._serve(self))

    def data_received(self, data: bytes) -> None:
        self._buffer = self._buffer[self._taken :] + data if self._buffer else data
        self._taken = 0
        if not self._reading_paused and not self._has_room():
            self._reading_paused = True
            assert self.transport is not None
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return True  # keep the transport: the requests that came before the end of file are answered

    def connection_lost(self, exc: Exception | None) -> None:
        self._eof = self._lost = True
        self._wake()
        if self._writing_paused is not None and not self._writing_paused.done():
            self._writing_paused.set_result(None)
        if not self.closed.done():
            self.closed.set_result(None)

    def pause_writing(self) -> None:
        if self._writing_paused is None or self._writing_paused.done():
            self._writing_paused = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writing_paused is not None and not self._writing_paused.done():
            self._writing_paused.set_result(None)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    # ---- the session's side ----------------------------------------------------------------------

    @property
    def buffered(self) -> int:
        """Bytes received and not yet taken."""
        return len(self._buffer) - self._taken

    @property
    def at_eof(self) -> bool:
        """The peer sent its end of file (or the connection is gone): no more bytes will come."""
        return self._eof

    async def wait(self) -> None:
        """Until more bytes come, or the end of file."""
        if self._eof:
            return
        self._waiter = waiter = asyncio.get_running_loop().create_future()
        await waiter

    def take_frame(self) -> bytes | None:
        """The next frame's body if it has come whole, else None; raises ProtocolError (BAD_FRAME)
        for a header that announces too large or an empty frame (the stream is then lost)."""
        buffer, start = self._buffer, self._taken
        if len(buffer) - start < HEADER.size:
            return None
        body_at = start + HEADER.size
        end = body_at + frame_length(buffer[start:body_at])
        if len(buffer) < end:
            self._need = end - start  # (reading may have paused before this frame's size was known)
            self._resume_if_room()
            return None
        body = buffer[body_at:end]
        if end == len(buffer):
            self._buffer, self._taken = b"", 0
        else:
            self._taken = end
        self._need = HEADER.size
        self._resume_if_room()
        return body

    def _has_room(self) -> bool:
        """At most _HIGH_WATER bytes wait beyond the frame being assembled."""
        return self.buffered <= self._need + _HIGH_WATER

    def _resume_if_room(self) -> None:
        if self._reading_paused and self._has_room():
            self._reading_paused = False
            assert self.transport is not None
            self.transport.resume_reading()

    def write(self, data: bytes) -> bool:
        """Send `data`; True if the kernel did not take it all at once (the caller may `drain`)."""
        assert self.transport is not None
        self.transport.write(data)
        return bool(self.transport.get_write_buffer_size())

    async def drain(self) -> None:
        """Until the transport's write buffer is under its high-water mark (at once if it is)."""
        paused = self._writing_paused
        if paused is not None and not paused.done():
            await paused
        if self._lost:
            raise ConnectionResetError("the client went away")

    def close(self) -> None:
        """Close once what was written has been sent (`closed` resolves then)."""
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        """Close now, dropping what the client has not read."""
        if self.transport is not None:
            self.transport.abort()

    def peer_socket(self) -> Any:
        assert self.transport is not None
        return self.transport.get_extra_info("socket")
