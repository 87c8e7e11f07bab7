"""The plain half of the wire format: framing, error codes, the version handshake rule, socket paths.

Standard library only, because the client imports it: `gpusched submit` must start like a small
tool, and pydantic with the protocol's models costs it ~100 ms. The pydantic models of every request
and result live in `gpusched.protocol`, which re-exports everything here so the daemon keeps one
import. A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON (one
object); frames over `MAX_FRAME` are refused before they are read. See docs/protocol.md.
"""

from __future__ import annotations

import json
import os
import struct
from enum import StrEnum

TYPE_CHECKING = False  # typing costs the fast path a few ms to import; mypy reads this as True
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any

PROTOCOL_VERSION = "1.1"  # 1.1: job arrays, submit request_id
MAX_FRAME = 1 << 20  # 1 MiB
# The smallest share a submit may ask for: MPS caps a client's SMs in whole percent, so a smaller
# one would run with 1 % and be charged its own tiny fraction (checked by SubmitRequest and the CLI).
MIN_SHARE = 0.01
MAX_MEM_MIB = 2**43 - 1  # --mem: what cgroup v2's memory.max takes (2^63 - 1 bytes), in MiB
HEADER = struct.Struct(">I")


class ErrorCode(StrEnum):
    """Stable error codes; scripts may match on them."""

    BAD_FRAME = "bad_frame"  # not a frame: too large, not UTF-8, not a JSON object
    BAD_REQUEST = "bad_request"  # a JSON object that is not a valid request
    VERSION_MISMATCH = "version_mismatch"
    HELLO_REQUIRED = "hello_required"
    NOT_FOUND = "not_found"
    PERMISSION_DENIED = "permission_denied"
    UNSATISFIABLE = "unsatisfiable"
    INVALID_STATE = "invalid_state"
    LIMIT_EXCEEDED = "limit_exceeded"  # a per-user limit (pending jobs, submit rate); retry later
    SHUTTING_DOWN = "shutting_down"
    INTERNAL = "internal"


class ProtocolError(Exception):
    """An error that travels to the peer as `{ok: false, error: {...}}`."""

    def __init__(self, code: ErrorCode, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.hint = hint



def encode_frame(obj: dict[str, Any]) -> bytes:
    """Serialise one message; refuses to build a frame the peer would reject."""
    return frame(json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))


def frame(body: bytes) -> bytes:
    """A serialised message with its header; refuses to build a frame the peer would reject."""
    if len(body) > MAX_FRAME:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"message of {len(body)} bytes exceeds the {MAX_FRAME}-byte limit")
    return HEADER.pack(len(body)) + body


def frame_length(header: bytes) -> int:
    """Length announced by a header; raises BAD_FRAME for frames over the limit or empty ones."""
    length: int = HEADER.unpack(header)[0]
    if length > MAX_FRAME:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"frame of {length} bytes exceeds the {MAX_FRAME}-byte limit")
    if length == 0:
        raise ProtocolError(ErrorCode.BAD_FRAME, "empty frame")
    return length


def decode_body(body: bytes) -> dict[str, Any]:
    """Parse a frame body into a JSON object, with an error that says what was wrong."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"frame is not valid UTF-8 (byte {exc.start})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"frame is not valid JSON: {exc.msg} at position {exc.pos}") from None
    except RecursionError:
        raise ProtocolError(ErrorCode.BAD_FRAME, "frame is nested too deeply") from None
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise ProtocolError(ErrorCode.BAD_FRAME, f"frame is not acceptable JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.BAD_FRAME, f"frame must hold a JSON object, not {type(obj).__name__}")
    return obj



def check_version(peer: str) -> None:
    """Refuse a peer whose major version differs; minor versions are compatible by design."""
    mine = PROTOCOL_VERSION.split(".", 1)[0]
    theirs = peer.split(".", 1)[0]
    if mine != theirs:
        raise ProtocolError(
            ErrorCode.VERSION_MISMATCH,
            f"protocol version mismatch: daemon speaks {PROTOCOL_VERSION}, client speaks {peer}",
            "install the same gpusched version for the client and the daemon",
        )



ROOT_SOCKET = "/run/gpusched/gpusched.sock"


def user_socket(uid: int, env: Mapping[str, str]) -> str:
    """Where an unprivileged daemon of `uid` listens: $XDG_RUNTIME_DIR, else /tmp/gpusched-$UID."""
    runtime = env.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "gpusched", "gpusched.sock")
    return f"/tmp/gpusched-{uid}/gpusched.sock"


def socket_candidates(uid: int, env: Mapping[str, str]) -> list[str]:
    """Default sockets in the order the client tries them: the system daemon, then the user's own."""
    candidates = [ROOT_SOCKET, user_socket(uid, env)]
    fallback = f"/tmp/gpusched-{uid}/gpusched.sock"
    if fallback not in candidates:
        candidates.append(fallback)
    return candidates
