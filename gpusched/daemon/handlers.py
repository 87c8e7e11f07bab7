"""One function per request: (ctx, request) -> result. Handlers never see a socket.

This module is the table of them; they live in handlers_jobs (jobs), handlers_node (GPUs, stats,
doctor, reload, shutdown) and handlers_common (the context and the checks they share).

Identity comes from `ctx.peer` (SO_PEERCRED, filled in by the server), never from the payload.
Errors are raised as ProtocolError with a stable code; the server turns them into error frames.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from gpusched import __version__
from gpusched.daemon.handlers_common import Context as Context
from gpusched.daemon.handlers_common import Peer as Peer
from gpusched.daemon.handlers_jobs import cancel, hold, logs, queue, release, resume, show, submit, suspend, wait
from gpusched.daemon.handlers_node import (
    doctor,
    gpu_drain,
    gpu_resume,
    gpus,
    mig_apply,
    reload,
    shutdown,
    sim_inject_xid,
    stats,
    watch,
)
from gpusched.protocol import (
    PROTOCOL_VERSION,
    HelloRequest,
    HelloResult,
    check_version,
)


def hello(ctx: Context, req: HelloRequest) -> HelloResult:
    check_version(req.version)
    return HelloResult(
        version=PROTOCOL_VERSION, daemon_version=__version__, uid=ctx.peer.uid, user=ctx.user,
        admin=ctx.admin, backend=ctx.backend_name,
    )


Handler = Callable[[Context, Any], Any | Awaitable[Any]]
HANDLERS: dict[str, Handler] = {
    "hello": hello, "submit": submit, "queue": queue, "show": show, "cancel": cancel,
    "logs": logs, "wait": wait, "suspend": suspend, "resume": resume, "hold": hold, "release": release,
    "gpu_drain": gpu_drain, "gpu_resume": gpu_resume, "mig_apply": mig_apply, "sim_inject_xid": sim_inject_xid,
    "doctor": doctor, "reload": reload, "stats": stats, "watch": watch, "gpus": gpus, "shutdown": shutdown,
}
