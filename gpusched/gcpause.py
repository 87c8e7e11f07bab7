"""The cyclic garbage collector kept off what a process loads to keep.

Loading 100k queued jobs (the daemon) or a trace (replay) allocates millions of objects and none of
them is garbage, yet every 700 allocations start a collection, and the full ones walk everything
loaded so far: measured, that was half the CPU of a restart (2.0 s of 4.0 s at 100k distinct
specs). So a load runs with the collector paused, and the process that owns the load then freezes what
it loaded (`gc.freeze()`: no later collection walks it; gpuschedd after the engine starts, replay
after reading the trace): a full collection over a large queue is a pause of the event loop, and
in replay it landed inside scheduling decisions (about 5% of decision time on the Alibaba
`gpushare100` trace). No collection runs before the freeze: what a load leaves is not garbage, and
a collection over a large heap is the pause this avoids. Reference counting still frees what a load
drops and frozen objects once released; only cycles wait for the collector, which runs again as
soon as the load ends.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


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
