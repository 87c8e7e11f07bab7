"""The Unix socket server: peer identity from SO_PEERCRED, framing, handshake, connection limits.

Every connection is independent: a malformed frame gets an error (and, when the stream can no
longer be trusted, the connection is closed) while everyone else keeps being served.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import pwd
import socket
import stat
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, cast

from pydantic import BaseModel

from gpusched.daemon.connection import Connection
from gpusched.daemon.deadlines import Deadline, Deadlines
from gpusched.daemon.engine import Engine
from gpusched.daemon.handlers import HANDLERS, Context, Peer
from gpusched.daemon.safepath import unsafe_reason
from gpusched.protocol import (
    HEADER,
    ErrorCode,
    HelloRequest,
    ProtocolError,
    ReloadResult,
    encode_frame,
    error,
    ok,
    ok_body,
    parse_frame,
)
from gpusched.protocol import frame as to_frame

log = logging.getLogger("gpusched.server")
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
HELLO_TIMEOUT_S = 10.0


class SocketInUse(Exception):
    """Another live daemon already answers on the socket."""


def peer_credentials(sock: socket.socket) -> Peer:
    pid, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return Peer(pid=pid, uid=uid, gid=gid)


def claim_socket_path(path: str) -> None:
    """Refuse if a live daemon owns `path`; remove it if it is a stale leftover. Its directory must
    not be another user's, nor writable by everyone but for root's sticky ones (safepath.py): whoever
    may write there may replace the socket."""
    directory = os.path.dirname(path) or "."
    unsafe = unsafe_reason(directory, os.geteuid())
    if unsafe is not None:
        raise SocketInUse(f"socket {path}: its directory is not safe to use: {unsafe}; choose another with "
                          "--socket (or remove what another user created there)")
    os.makedirs(directory, mode=0o755, exist_ok=True)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise SocketInUse(f"{path} exists and is not a socket; refusing to remove it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # nobody listens: a daemon died without cleaning up
        return
    finally:
        probe.close()
    raise SocketInUse(f"another gpuschedd is already listening on {path}")


class Server:
    """Accepts connections and dispatches requests to handlers."""

    def __init__(self, engine: Engine, path: str, backend_name: str, request_shutdown: Callable[[], None],
                 max_connections: int = 1024, idle_timeout_s: float = 600.0, read_timeout_s: float = 30.0) -> None:
        self.engine = engine
        self.idle_timeout_s = idle_timeout_s  # between requests (after hello)
        self.read_timeout_s = read_timeout_s  # to finish a frame once its first byte came, and to take a reply
        self.path = path
        self.backend_name = backend_name
        self.request_shutdown = request_shutdown
        self.max_connections = max_connections
        self.reload: Callable[[], Awaitable[ReloadResult]] | None = None  # set by daemon.main.start
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._closing = False
        self._per_uid: dict[int, int] = {}
        self.refused_connections = 0  # over max_connections or a user's share, since start
        self._deadlines = Deadlines(self._tick_s)

    def _tick_s(self) -> float:
        """How often read deadlines are checked: a quarter of the shortest bound (deadlines.py)."""
        return min(1.0, max(0.01, min(HELLO_TIMEOUT_S, self.idle_timeout_s, self.read_timeout_s) / 4))

    @property
    def per_uid_limit(self) -> int:
        """Connections one ordinary user may hold: a quarter of the total, and at least 8."""
        return max(8, self.max_connections // 4)

    async def start(self) -> None:
        """Listen. Called only once the engine has loaded every job: nobody is served a half-loaded state."""
        claim_socket_path(self.path)
        self._server = await asyncio.get_running_loop().create_unix_server(lambda: Connection(self._serve),
                                                                            path=self.path)
        os.chmod(self.path, 0o666)  # anyone may connect; SO_PEERCRED decides what they may do

    async def close(self, grace_s: float = 10.0) -> None:
        """Stop accepting, let in-flight requests finish (up to `grace_s`), then drop connections."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        self.engine.begin_shutdown()  # long-polls (wait, logs -f) answer now instead of at their timeout
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), grace_s)
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
        await self._deadlines.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    async def _serve(self, conn: Connection) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        counted = False
        peer = Peer(0, 0, 0)
        try:
            peer = peer_credentials(conn.peer_socket())
            mine = self._per_uid.get(peer.uid, 0) + 1
            self._per_uid[peer.uid] = mine
            counted = True
            # One user may not take every slot: root (and the daemon's own user) is never locked out.
            if len(self._connections) > self.max_connections or (
                    peer.uid not in (0, os.geteuid()) and mine > self.per_uid_limit):
                self.refused_connections += 1
                await self._send(conn, error(ErrorCode.INTERNAL, "too many connections",
                                             "close idle gpusched clients (e.g. `top`) and try again"))
                return
            await self._session(conn, peer)
        except (ConnectionError, TimeoutError):
            pass  # the client went away, or stopped reading our replies: nothing more to say
        finally:
            self._connections.discard(task)
            if counted:
                self._per_uid[peer.uid] -= 1
                if not self._per_uid[peer.uid]:
                    del self._per_uid[peer.uid]
            await self._hang_up(conn)

    async def _hang_up(self, conn: Connection) -> None:
        """Close the connection once the kernel has taken what was written to it, within read_timeout_s;
        at once if the daemon is stopping. A client that reads none of its answers must hold neither
        its slot nor the daemon's shutdown."""
        if self._closing:
            conn.abort()
            return
        conn.close()
        if not conn.closed.done():
            try:
                async with asyncio.timeout(self.read_timeout_s):
                    await asyncio.shield(conn.closed)
            except TimeoutError:
                conn.abort()
            except asyncio.CancelledError:
                conn.abort()  # the daemon began to stop meanwhile
                raise

    async def _session(self, conn: Connection, peer: Peer) -> None:
        user = self.engine.user_name(peer.uid)
        ctx = Context(self.engine, peer, user, self.engine.is_admin(peer.uid), self.backend_name,
                      self.request_shutdown, self.path, self.reload)
        greeted = False
        deadline = self._deadlines.watch()
        # One hello deadline from the connect: answering other requests (hello_required) must not
        # start it again, or a client could stay connected without ever saying who it is.
        hello_by = asyncio.get_running_loop().time() + HELLO_TIMEOUT_S
        try:
            while not self._closing:
                body = await self._read_frame(conn, deadline, greeted, hello_by)
                if body is None:
                    return
                self._begin()
                try:
                    reply, greeted = await self._answer(ctx, body, greeted)
                finally:
                    self._end()
                if isinstance(reply, AsyncIterator):
                    await self._stream(conn, reply)  # the connection now belongs to the stream
                    return
                await self._send(conn, reply)
        finally:
            self._deadlines.forget(deadline)

    async def _read_frame(self, conn: Connection, deadline: Deadline, greeted: bool, hello_by: float) -> bytes | None:
        """The next request's body, or None when the connection is to be closed (after saying why, when
        there is something to say).

        Every read has a deadline: a connection that never says hello, sits idle too long, or stalls
        in the middle of a frame is closed, so it cannot hold a slot (and a file) for ever. One ticker
        keeps them for every connection (deadlines.py): a timer per read was a visible share of the
        daemon's CPU at thousands of requests a second."""
        framing = False  # the first byte came: the frame must now be finished within read_timeout_s
        try:
            if not conn.buffered:
                deadline.arm(self.idle_timeout_s if greeted else max(0.0, hello_by - asyncio.get_running_loop().time()))
                while not conn.buffered:
                    if conn.at_eof:
                        return None
                    await conn.wait()
            framing = True
            deadline.arm(self.read_timeout_s)
            while (body := conn.take_frame()) is None:
                if conn.at_eof:  # the rest of the frame never comes
                    if conn.buffered < HEADER.size:
                        deadline.disarm()
                        await self._send(conn, error(ErrorCode.BAD_FRAME, "truncated frame header"))
                    return None
                await conn.wait()
            return body
        except asyncio.CancelledError:
            if not deadline.fired():
                raise
            if framing:
                await self._send(conn, error(ErrorCode.BAD_FRAME, f"frame not completed within "
                                             f"{self.read_timeout_s:g} s; closing"))
            elif not greeted:
                await self._send(conn, error(ErrorCode.HELLO_REQUIRED,
                                             f"no hello within {HELLO_TIMEOUT_S:g} s; closing"))
            return None  # idle after hello: close quietly (a client reconnects when it needs to)
        except ProtocolError as exc:
            # The announced body is not read, so the stream cannot be resynchronised: close.
            deadline.disarm()
            await self._send(conn, error(exc.code, exc.message, exc.hint))
            return None
        finally:
            deadline.disarm()

    async def _stream(self, conn: Connection, results: AsyncIterator[BaseModel]) -> None:
        """Send each result of a streaming request until the client hangs up or we shut down."""
        hangup = asyncio.ensure_future(_hangup(conn))  # a streaming client sends nothing more
        try:
            async for result in results:
                if hangup.done() or self._closing:
                    break
                await self._send(conn, ok(result))
        finally:
            hangup.cancel()
            await results.aclose()  # type: ignore[attr-defined]

    async def _answer(
        self, ctx: Context, body: bytes, greeted: bool
    ) -> tuple[dict[str, Any] | bytes | AsyncIterator[BaseModel], bool]:
        try:
            request = parse_frame(body)
            if not greeted and not isinstance(request, HelloRequest):
                raise ProtocolError(ErrorCode.HELLO_REQUIRED, "the first request on a connection must be hello")
            if isinstance(request, HelloRequest):
                self._check_peer_allowed(ctx)
            if self._closing and not isinstance(request, HelloRequest):
                raise ProtocolError(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down", "retry in a moment")
            result = HANDLERS[request.op](ctx, request)
            if inspect.isasyncgen(result):
                return cast(AsyncIterator[BaseModel], result), greeted
            if inspect.isawaitable(result):
                result = await result
            fast = ok_body(result)
            return (fast if fast is not None else ok(result)), greeted or isinstance(request, HelloRequest)
        except ProtocolError as exc:
            return error(exc.code, exc.message, exc.hint), greeted
        except Exception:
            log.exception("handler failed for uid %d", ctx.peer.uid)
            return error(ErrorCode.INTERNAL, "internal error in gpuschedd", "see the daemon's log"), greeted

    def _check_peer_allowed(self, ctx: Context) -> None:
        me = os.geteuid()
        if me != 0 and ctx.peer.uid != me:
            owner = _name(me)
            raise ProtocolError(
                ErrorCode.PERMISSION_DENIED,
                f"this gpuschedd runs unprivileged as {owner} and serves only {owner}",
                "use the system daemon (run as root), or start your own with `gpuschedd --sim ...`",
            )

    def _begin(self) -> None:
        self._in_flight += 1
        self._idle.clear()

    def _end(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()

    async def _send(self, conn: Connection, message: dict[str, Any] | bytes) -> None:
        """Send a message (or the JSON body of one, already serialised)."""
        try:
            frame = to_frame(message) if isinstance(message, bytes) else encode_frame(message)
        except ProtocolError as exc:  # a reply too large for one frame: say so instead of hanging up
            frame = encode_frame(error(ErrorCode.INTERNAL, f"the reply is too large to send: {exc.message}",
                                       "ask for less (e.g. `queue --user`, a smaller --limit)"))
        if conn.write(frame):  # the kernel did not take it all at once
            # A client that stops reading must not hold the reply (and its connection) for ever.
            async with asyncio.timeout(self.read_timeout_s):
                await conn.drain()


async def _hangup(conn: Connection) -> None:
    """Until a streaming client sends anything, or its end of file: either way it is done listening."""
    if not conn.buffered:
        await conn.wait()


def _name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"
