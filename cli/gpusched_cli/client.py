"""A small synchronous client: connect, `hello`, then request -> result calls.

Blocking sockets are right here: the CLI does one thing at a time, and a plain socket keeps the
client's start-up cheap (no event loop for a one-shot `gpusched queue`). For the same reason this
module imports no pydantic: `request` sends and returns plain JSON objects (the CLI's path); `call`
takes and returns the protocol's models for typed callers (tests, benchmarks, `top`), importing
them only when used.
"""

from __future__ import annotations

# `_socket`, the C module that `socket` wraps: what a one-shot client needs (connect, sendall, recv,
# getsockopt) without the enum classes `socket` builds at import, ~5 ms of the fast path's start.
import _socket
import errno
import os
import stat
import struct

from gpusched.wire import (
    HEADER,
    PROTOCOL_VERSION,
    ErrorCode,
    ProtocolError,
    decode_body,
    encode_frame,
    frame_length,
    socket_candidates,
    user_socket,
)

TYPE_CHECKING = False  # typing costs the fast path a few ms to import; mypy reads this as True
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any, TypeVar

    from pydantic import BaseModel

    T = TypeVar("T", bound=BaseModel)
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class DaemonUnavailable(Exception):
    """No daemon answers at the socket; the message says where we looked and how to start one."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


class ConnectionClosed(DaemonUnavailable):
    """The daemon closed a connection it had accepted, before its answer: killed, restarting or
    shutting down after it read the request. Unlike a missing socket, worth trying again (submit)."""


def resolve_socket(explicit: str | None, env: Mapping[str, str] | None = None, uid: int | None = None) -> str:
    """`--socket`, else $GPUSCHED_SOCKET, else the first default socket that accepts connections."""
    env = os.environ if env is None else env
    if explicit:
        return explicit
    if env.get("GPUSCHED_SOCKET"):
        return env["GPUSCHED_SOCKET"]
    me = os.getuid() if uid is None else uid
    candidates = socket_candidates(me, env)
    existing = [path for path in candidates if os.path.exists(path)]
    for path in existing:
        if _listening(path):
            return path
    # none answers: the first that exists is the one the error names; with none, root's system
    # socket, and for anyone else their own daemon's (the hint's `gpuschedd --socket` must be one
    # they can start: /run/gpusched is root's)
    return existing[0] if existing else candidates[0] if me == 0 else user_socket(me, env)


def _listening(path: str) -> bool:
    """Does something accept connections there? A socket a crashed daemon left behind refuses them,
    and must not hide your own daemon's socket further down the list. Nothing is sent."""
    probe = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError:
        return False
    finally:
        probe.close()
    return True


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def _trusted(uid: int) -> bool:
    return uid in (0, os.getuid())


def _untrusted(path: str, what: str, uid: int) -> DaemonUnavailable:
    return DaemonUnavailable(
        f"refusing to use {path}: {what} belongs to uid {uid}, not to root or you; nothing was sent",
        "another user may have planted it to read your requests (they carry your environment); remove it, "
        "or name your daemon's socket with --socket",
    )


def check_socket_owner(path: str) -> None:
    """Refuse a socket, or a directory holding it, owned by anyone but root or the caller (before any
    byte is sent: a submit carries the whole environment, tokens included)."""
    try:
        info = os.stat(path)
    except OSError:
        return  # missing or unreachable: connect() says so
    if not _trusted(info.st_uid):
        raise _untrusted(path, "the socket", info.st_uid)
    directory = os.path.dirname(os.path.realpath(path))
    with_dir = os.stat(directory)
    if not _trusted(with_dir.st_uid):
        raise _untrusted(path, f"its directory {directory}", with_dir.st_uid)


def check_daemon_identity(sock: _socket.socket, path: str) -> None:
    """The process listening must run as root or as the caller (SO_PEERCRED), whoever owns the file."""
    _pid, uid, _gid = _PEERCRED.unpack(sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, _PEERCRED.size))
    if not _trusted(uid):
        raise _untrusted(path, "the process listening on it", uid)


class Client:
    """One connection to the daemon. Use as a context manager."""

    def __init__(self, path: str, timeout: float = 60.0) -> None:
        self.path = path
        self.timeout = timeout
        self._sock: _socket.socket | None = None
        self.hello: dict[str, Any] | None = None  # the daemon's HelloResult, as JSON

    def __enter__(self) -> Client:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connect(self) -> dict[str, Any]:
        check_socket_owner(self.path)
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
            check_daemon_identity(sock, self.path)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            state = ("does not exist" if isinstance(exc, FileNotFoundError) else
                     "is not a socket" if not _is_socket(self.path) else "refuses connections (stale socket)")
            raise DaemonUnavailable(
                f"gpuschedd is not running: socket {self.path} {state}",
                "start it with `sudo systemctl start gpusched`, or run your own on simulated GPUs: "
                f"`gpuschedd --sim H100-80GB:2 --socket {self.path}`",
            ) from None
        except DaemonUnavailable:
            sock.close()
            raise
        except PermissionError:
            sock.close()
            raise DaemonUnavailable(
                f"permission denied connecting to {self.path}",
                "the socket should be mode 0666; check the daemon's --socket directory permissions",
            ) from None
        except OSError as exc:  # a path through a file, one too long for a socket, a datagram socket, ...
            sock.close()
            why = ("is not a stream socket" if exc.errno == errno.EPROTOTYPE
                   else f"cannot be used: {exc.strerror or exc}")
            raise DaemonUnavailable(
                f"cannot reach gpuschedd: socket {self.path} {why}",
                "name the daemon's socket with --socket (or $GPUSCHED_SOCKET); `gpuschedd --help` shows where it "
                "listens",
            ) from None
        self._sock = sock
        try:
            # HelloRequest's fields in its order: the frame is byte for byte what the model would send.
            self.hello = self.request({"op": "hello", "version": PROTOCOL_VERSION, "client": "gpusched-cli"})
        except BaseException:
            self.close()  # a refused hello (version mismatch, not allowed) must not leak the socket
            raise
        return self.hello

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send one request (a plain JSON object) and return its result object as it came, or raise
        ProtocolError from the daemon. The caller reads the result lazily (see `results.reading`)."""
        reply = self.raw_call(message)
        if reply.get("ok") is True:
            result = reply.get("result")
            if not isinstance(result, dict):
                raise ProtocolError(ErrorCode.BAD_FRAME, f"daemon sent a malformed result: {result!r:.200}")
            return result
        raise _daemon_error(reply)

    def call(self, request: BaseModel | dict[str, Any], result_type: type[T]) -> T:
        """Send one request and return its typed result, or raise ProtocolError from the daemon."""
        from pydantic import ValidationError  # typed callers have pydantic loaded already

        message = request if isinstance(request, dict) else request.model_dump(mode="json")
        reply = self.raw_call(message)
        if reply.get("ok") is True:
            try:
                return result_type.model_validate(reply.get("result"))
            except ValidationError as exc:
                raise ProtocolError(ErrorCode.BAD_FRAME, f"daemon sent a malformed result: {exc}") from None
        raise _daemon_error(reply)

    def raw_call(self, message: dict[str, Any]) -> dict[str, Any]:
        if self._sock is None:
            raise RuntimeError("not connected")
        self._sock.sendall(encode_frame(message))
        return self.read_reply()

    def read_reply(self) -> dict[str, Any]:
        """The next frame from the daemon (a streaming request such as `watch` sends many)."""
        header = self._recv_exactly(HEADER.size)
        return decode_body(self._recv_exactly(frame_length(header)))

    def _recv_exactly(self, n: int) -> bytes:
        assert self._sock is not None
        chunks = bytearray()
        while len(chunks) < n:
            chunk = self._sock.recv(n - len(chunks))
            if not chunk:
                raise ConnectionClosed(
                    f"gpuschedd closed the connection on {self.path}",
                    "the daemon may be shutting down; see `journalctl -u gpusched` or its log",
                )
            chunks += chunk
        return bytes(chunks)


def _daemon_error(reply: dict[str, Any]) -> ProtocolError:
    """The daemon's `{ok: false, error: {code, message, hint}}` as the exception the CLI maps to an exit code."""
    err = reply.get("error") or {}
    try:
        code = ErrorCode(err.get("code", "internal"))
    except ValueError:
        code = ErrorCode.INTERNAL
    return ProtocolError(code, str(err.get("message", "unknown error")), str(err.get("hint", "")))


def result_type_for(op: str) -> type[BaseModel]:
    from gpusched.protocol import RESULT_TYPES

    return RESULT_TYPES[op]
