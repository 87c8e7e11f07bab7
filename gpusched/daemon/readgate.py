"""One user's big reads (`stats`, `queue --all`) take their turn (handlers_common._read)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class ReadGate:
    """Big reads run on worker threads, but those threads share the interpreter with the event loop
    and the thread pool with the engine's own calls: one user's 50 connections asking for `stats`
    in a loop made `queue` take 14 s and held back scheduling. So each user has one such read in
    flight at a time (their others wait their turn, costing nothing), and all users MAX_READS."""

    MAX_READS = 2

    def __init__(self) -> None:
        self._all: asyncio.Semaphore | None = None
        self._per_uid: dict[int, tuple[asyncio.Semaphore, int]] = {}  # uid -> (its slot, requests holding it)

    @contextlib.asynccontextmanager
    async def slot(self, uid: int) -> AsyncIterator[None]:
        if self._all is None:
            self._all = asyncio.Semaphore(self.MAX_READS)
        mine, users = self._per_uid.get(uid, (asyncio.Semaphore(1), 0))
        self._per_uid[uid] = (mine, users + 1)
        try:
            async with mine, self._all:
                yield
        finally:
            left = self._per_uid[uid][1] - 1
            if left:
                self._per_uid[uid] = (mine, left)
            else:
                del self._per_uid[uid]
