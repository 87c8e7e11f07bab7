"""A submit that survives a daemon restart without being queued twice.

Every submit carries a random `request_id`. When the connection breaks after the request went out
and before its answer came back (the daemon was killed, restarted, or is shutting down), we cannot
know whether the job was committed; so we reconnect and send the very same request again. The
daemon keeps each user's request_ids with their jobs: if the first attempt was committed, the
second returns that job (`duplicate: true`) instead of creating another one.
"""

from __future__ import annotations

import time
import uuid

from gpusched.protocol import ErrorCode, ProtocolError, SubmitRequest, SubmitResult
from gpusched_cli.client import Client, DaemonUnavailable

RETRY_FOR_S = 30.0  # how long we keep trying to reach a restarting daemon
_PAUSE_S = 0.2


def new_request_id() -> str:
    return uuid.uuid4().hex


def submit(client: Client, request: SubmitRequest, retry_for_s: float = RETRY_FOR_S) -> SubmitResult:
    """`client.call(request)`, sent again (same request_id) on a fresh connection while the daemon is
    unreachable or restarting, for up to `retry_for_s`. `client` is reconnected in place."""
    if client.hello is not None and client.hello.version == "1.0":  # request_id came with protocol 1.1
        return client.call(request.model_copy(update={"request_id": None}), SubmitResult)  # sent once, never again
    assert request.request_id is not None, "only an idempotent submit may be sent twice"
    deadline = time.monotonic() + retry_for_s
    while True:
        try:
            return client.call(request, SubmitResult)
        except ProtocolError as exc:
            if exc.code is not ErrorCode.SHUTTING_DOWN or time.monotonic() > deadline:
                raise  # the daemon answered: that answer stands
        except (DaemonUnavailable, ConnectionError, TimeoutError):
            if time.monotonic() > deadline:
                raise
        _reconnect(client, deadline)


def _reconnect(client: Client, deadline: float) -> None:
    while True:
        client.close()
        time.sleep(_PAUSE_S)  # a restarting daemon needs a moment; this is a retry pause, not a wait for state
        try:
            client.connect()
            return
        except (DaemonUnavailable, ConnectionError, TimeoutError):
            if time.monotonic() > deadline:
                raise
