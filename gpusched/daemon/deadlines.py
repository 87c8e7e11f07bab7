"""Read deadlines for every client connection, kept by one ticker instead of a timer per read.

Each connection must say hello within a bound, may sit idle between requests only so long, and
must finish a frame it has begun (server.py). Those deadlines were one `asyncio.timeout` around
each read, two per request: a timer made and cancelled every time, about 7 us of the event
loop's time per request, measured, a tenth of what a durable submit costs it. Here a connection
moves its own deadline (two attribute writes) and one ticker cancels the reads that overran. A
deadline therefore fires up to one tick late, never early; the server's tick is a quarter of the
shortest bound in force, at most 1 s (with the defaults a 30 s bound fires between 30 and 31 s).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable


class Deadline:
    """One connection's deadline: `arm` before a read, `disarm` after it. When the ticker finds it
    overrun it cancels the connection's task, and the read raises CancelledError; `fired()` then
    tells that cancellation from any other (and takes it back, so the connection can answer)."""

    __slots__ = ("_at", "_fired", "_loop", "_task")

    def __init__(self, task: asyncio.Task[None], loop: asyncio.AbstractEventLoop) -> None:
        self._task = task
        self._loop = loop
        self._at = math.inf
        self._fired = False

    def arm(self, seconds: float) -> None:
        self._at = self._loop.time() + seconds

    def disarm(self) -> None:
        self._at = math.inf

    def fired(self) -> bool:
        """True if the ticker cancelled the read and nothing else did (once per firing): the
        ticker's cancel is taken back. False if another cancel came too (the server shutting down
        in the same loop turn): that one stands, and the CancelledError must go on up."""
        if not self._fired:
            return False
        self._fired = False
        return self._task.uncancel() == 0

    def _expire(self, now: float) -> None:
        if self._at <= now and not self._fired:
            self._at = math.inf
            self._fired = True
            self._task.cancel()  # the task waits in a read: only armed between a read's start and end


class Deadlines:
    """The ticker: runs while some connection is watched, checks every deadline once a tick."""

    def __init__(self, tick_s: Callable[[], float]) -> None:
        self._tick_s = tick_s  # read every tick: a reload may change the bounds
        self._watched: set[Deadline] = set()
        self._ticker: asyncio.Task[None] | None = None

    def watch(self) -> Deadline:
        """A deadline for the calling task (a connection), unarmed; `forget` it when the connection ends."""
        task = asyncio.current_task()
        assert task is not None, "a deadline belongs to a task"
        deadline = Deadline(task, asyncio.get_running_loop())
        self._watched.add(deadline)
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick(), name="gpusched-read-deadlines")
        return deadline

    def forget(self, deadline: Deadline) -> None:
        deadline.disarm()
        self._watched.discard(deadline)

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while self._watched:
            await asyncio.sleep(self._tick_s())
            now = loop.time()
            for deadline in list(self._watched):
                deadline._expire(now)
