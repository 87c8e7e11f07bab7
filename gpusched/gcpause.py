"""The cyclic garbage collector kept off what a process loads to keep.

Loading 100k queued jobs (the daemon) or a trace (replay) allocates millions of objects and none of
them is garbage, yet every 700 allocations start a collection, and the full ones walk everything
loaded so far: measured, that was half the CPU of a restart (2.0 s of 4.0 s at 100k distinct
specs). So a load runs with the collector paused, and the process that owns the load then freezes what
it loaded (`gc.freeze()`: no later collection walks it; gpuschedd after the engine starts, replay
after reading the trace): a full collection over a large queue is a pause of the event loop, and
in replay it landed inside scheduling decisions (about 5% of decision time on the Alibaba
`gpushare100` trace). No collection runs before the freeze: what a load leaves is not garbage, and
a collection over a large heap is the pause this avoids. (The first allocation after a pause starts
a collection of the youngest generation, which then holds everything the load made: gpuschedd's
own process keeps the collector off from its start until the freeze, which saved 0.7 s of CPU of a
restart at 100k queued jobs.) Reference counting still frees what a load
drops and frozen objects once released; only cycles wait for the collector, which runs again as
soon as the load ends.

A daemon keeps accepting jobs after its load, and they live on too: with 23k queued jobs a full
collection took 44 ms of the event loop, three of them in 20,000 submits, a tenth of the loop's
time (measured with gc.callbacks while 16 clients submitted); a replay builds its jobs as they
arrive, and its full collections took 0.25 s of the 3 s the default Alibaba trace takes.
`LongLivedHeap` freezes what survives each full collection, so the next one walks only what came
since; and since a frozen cycle that dies later is never collected, the daemon unfreezes and walks
everything once an hour.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

SWEEP_INTERVAL_S = 3600.0  # how often a long-running process walks everything once (LongLivedHeap)


@contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic collection inside the block; the collector's state is restored after it (an
    embedding program that had turned it off keeps it off)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class LongLivedHeap:
    """For a process whose heap mostly lives on (gpuschedd's queue, a replay's jobs): freeze what
    survives each full collection, and (a long-running one) sweep everything now and then.

    Right after a full collection nothing unreachable is left, so freezing then keeps no garbage;
    objects frozen and in a reference cycle that they later leave unreachable are only reclaimed by
    the sweep (unfreeze, collect, freeze), the one pause that still walks everything."""

    def __init__(self) -> None:
        self.frozen_after_full = 0  # full collections whose survivors were frozen
        self.sweeps = 0
        self._sweeper: asyncio.Task[None] | None = None

    def start(self, sweep_interval_s: float | None = SWEEP_INTERVAL_S) -> None:
        """Freeze what is there now (what was loaded), and from now on after every full collection;
        with `sweep_interval_s`, also sweep that often (needs a running event loop). A process that
        ends soon (a replay) needs no sweep: what a frozen cycle holds goes with the process."""
        gc.freeze()
        if self._after_collection not in gc.callbacks:
            gc.callbacks.append(self._after_collection)
        if sweep_interval_s is not None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_every(sweep_interval_s),
                                                                   name="gpusched-gc-sweep")

    def stop(self) -> None:
        """No more freezing after full collections, nor sweeps; what is frozen stays frozen."""
        if self._after_collection in gc.callbacks:
            gc.callbacks.remove(self._after_collection)
        if self._sweeper is not None:
            self._sweeper.cancel()

    def sweep(self) -> None:
        """Walk everything once: what a frozen cycle left behind is reclaimed."""
        gc.unfreeze()
        gc.collect()  # its own callback freezes the survivors
        self.sweeps += 1

    def _after_collection(self, phase: str, info: dict[str, Any]) -> None:
        # Called by the collector itself, after the collection (its lists are consistent), in
        # whichever thread allocated: freezing here leaves no window for new garbage to be frozen.
        if phase == "stop" and info["generation"] == 2:
            gc.freeze()
            self.frozen_after_full += 1

    async def _sweep_every(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.sweep()
