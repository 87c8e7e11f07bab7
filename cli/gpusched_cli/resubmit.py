"""A submit that survives a daemon restart without being queued twice.

Every submit carries a `request_id` of its own (`new_request_id`). When the connection breaks after
the request went out and before its answer came back (the daemon was killed, restarted, or is
shutting down), we cannot know whether the job was committed; so we reconnect and send the very
same request again. The daemon keeps each user's request_ids with their jobs: if the first attempt
was committed, the second returns that job (`duplicate: true`) instead of creating another one.

Plain JSON in and out, as the rest of the client (messages.py, results.py): no pydantic here.
"""

from __future__ import annotations

import os
import time

from gpusched.wire import ErrorCode, ProtocolError
from gpusched_cli.client import Client, DaemonUnavailable

TYPE_CHECKING = False  # typing costs the fast path a few ms to import; mypy reads this as True
if TYPE_CHECKING:
    from typing import Any

RETRY_FOR_S = 30.0  # how long we keep trying to reach a restarting daemon
_PAUSE_S = 0.2


def new_request_id() -> str:
    """32 hex digits: the time in nanoseconds (16), then 64 random bits (16).

    The daemon indexes request_ids by (uid, key). Keys in the order they were made land at the end
    of their user's part of that index, in a page each COMMIT writes anyway; 128 random bits (as
    uuid4 gives) landed each on a page of its own, for the COMMIT to write to the WAL and fsync
    (bench/bench_request_keys.py: a key cost a submit's store 2.9x the time of none, an ordered key
    1.4x). Unique all the same: two keys of one user would need the same nanosecond and the same
    64 bits. The C front (front.c) makes them the same way."""
    return f"{time.time_ns():016x}{os.urandom(8).hex()}"


def submit(client: Client, message: dict[str, Any], retry_for_s: float = RETRY_FOR_S) -> dict[str, Any]:
    """`client.request(message)` (a `submit` frame carrying a request_id), sent again on a fresh
    connection while the daemon is unreachable or restarting, for up to `retry_for_s`; the
    SubmitResult as JSON. `client` is reconnected in place."""
    if client.hello is not None and client.hello.get("version") == "1.0":  # request_id came with protocol 1.1
        once = {key: value for key, value in message.items() if key != "request_id"}
        return client.request(once)  # not idempotent for this daemon: sent once, never again
    assert message.get("request_id") is not None, "only an idempotent submit may be sent twice"
    deadline = time.monotonic() + retry_for_s
    while True:
        try:
            return client.request(message)
        except ProtocolError as exc:
            if exc.code is not ErrorCode.SHUTTING_DOWN or time.monotonic() > deadline:
                raise  # the daemon answered: that answer stands
        except (DaemonUnavailable, ConnectionError, TimeoutError):
            if time.monotonic() > deadline:
                raise
        reconnect(client, deadline)


def reconnect(client: Client, deadline: float) -> None:
    """Connect `client` again, pausing between tries, until it works or `deadline` (monotonic) passes."""
    while True:
        client.close()
        time.sleep(_PAUSE_S)  # a restarting daemon needs a moment; this is a retry pause, not a wait for state
        try:
            client.connect()
            return
        except (DaemonUnavailable, ConnectionError, TimeoutError):
            if time.monotonic() > deadline:
                raise
