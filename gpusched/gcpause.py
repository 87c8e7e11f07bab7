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

The daemon also starts a young collection after 10,000 net allocations instead of CPython's 700
(`DAEMON_YOUNG_THRESHOLD`). Under 16 clients the young collections at 700 came every ~60 submits
and walked whatever was young at that moment (the requests in flight, the jobs just accepted),
promoting it to be walked again by the middle generation's collections, and found no garbage at
all (0 collected in 8,000 submits): what a request leaves is freed by reference counting. Those
walks, and the collector's per-type traversal code, pushed the request path out of the CPU's caches.
callgrind's cache simulation of the daemon under 16 clients (a 512 KiB last level, as this CPU's
per-core L2; docs/benchmarks.md, round 20): 1,895-2,036 L2 misses per submit at 700, 1,687 at
10,000, 1,627 at 50,000, and 3% fewer instructions. At 10,000 a young collection came every ~1,300
submits and paused the loop 3-5 ms on this 2-vCPU machine (at 700: 0.2-0.75 ms every ~60, the
middle generation's 1.2-1.7 ms every ~670); 50,000 would pause several times longer. Cycles, of
which this daemon makes almost none, wait at most that many allocations to be reclaimed.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

SWEEP_INTERVAL_S = 3600.0  # how often a long-running process walks everything once (LongLivedHeap)
DAEMON_YOUNG_THRESHOLD = 10_000  # gpuschedd's first collection threshold (CPython's is 700): see above


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
        self._thresholds: tuple[int, int, int] | None = None  # the collector's before start(young_threshold)

    def start(self, sweep_interval_s: float | None = SWEEP_INTERVAL_S, young_threshold: int | None = None) -> None:
        """Freeze what is there now (what was loaded), and from now on after every full collection;
        with `sweep_interval_s`, also sweep that often (needs a running event loop). A process that
        ends soon (a replay) needs no sweep: what a frozen cycle holds goes with the process.
        `young_threshold`: the collector's first threshold from now on (gpuschedd's
        DAEMON_YOUNG_THRESHOLD); `stop` puts the previous ones back."""
        if young_threshold is not None:
            if young_threshold < 1:
                raise ValueError(f"young_threshold must be >= 1 (0 turns the collector off), not {young_threshold}")
            if self._thresholds is None:
                self._thresholds = gc.get_threshold()
            gc.set_threshold(young_threshold, *self._thresholds[1:])
        gc.freeze()
        if self._after_collection not in gc.callbacks:
            gc.callbacks.append(self._after_collection)
        if sweep_interval_s is not None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_every(sweep_interval_s),
                                                                   name="gpusched-gc-sweep")

    def stop(self) -> None:
        """No more freezing after full collections, nor sweeps, and the thresholds `start` found; what
        is frozen stays frozen."""
        if self._after_collection in gc.callbacks:
            gc.callbacks.remove(self._after_collection)
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._thresholds is not None:
            gc.set_threshold(*self._thresholds)
            self._thresholds = None

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
