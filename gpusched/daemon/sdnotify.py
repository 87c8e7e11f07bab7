"""Speaking to systemd as a Type=notify service: READY/STATUS/STOPPING, and the watchdog heartbeat."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket

from gpusched.daemon.engine import Engine
from gpusched.model import JobState


async def systemd_heartbeat(engine: Engine) -> None:
    """WATCHDOG=1 at half of WatchdogSec (from the event loop, so a stuck loop gets us restarted), and
    STATUS= with job counts for `systemctl status`. Does nothing outside a Type=notify service."""
    if not os.environ.get("NOTIFY_SOCKET"):
        return
    usec = os.environ.get("WATCHDOG_USEC", "")
    watchdog = usec.isdigit() and int(usec) > 0 and os.environ.get("WATCHDOG_PID", str(os.getpid())) == str(
        os.getpid())
    interval = int(usec) / 2e6 if watchdog else 5.0
    last = ""
    while True:
        jobs = engine.jobs.values()
        running = sum(1 for j in jobs if j.state is JobState.RUNNING)
        pending = sum(1 for j in jobs if j.state is JobState.PENDING)
        status = f"STATUS=serving: {running} running, {pending} pending on {len(engine.inventory.gpus)} GPUs"
        message = "\n".join(m for m in ("WATCHDOG=1" if watchdog else "", status if status != last else "") if m)
        if message:
            sd_notify(message)
        last = status
        await asyncio.sleep(interval)


def sd_notify(message: str) -> None:
    """Tell systemd about our state when run as a Type=notify service; a no-op elsewhere."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return
    if path.startswith("@"):
        path = "\0" + path[1:]
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(message.encode(), path)
