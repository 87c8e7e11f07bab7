"""Headroom for interactive work: devices kept free of batch jobs while interactive users are about.

Why: an interactive user who finds every GPU taken by a day-long training run waits a day, and
fair share alone cannot help, because nothing ends. The seed's answer (keep an instance for
latency-sensitive work) is a reservation sized from demand: while interactive jobs have been
seen in the last `interactive_window_s`, up to `interactive_headroom_gpus` devices are kept for them, the
ones already serving interactive jobs first, then share-capable and idle ones, then those whose batch jobs are
expected to end soonest. Batch jobs may not start there; when a device in the headroom is still
held by batch work, interactive jobs that wait past `interactive_preempt_after_s` may preempt it
(scheduler.py). When interactive users go quiet for a window, the headroom goes back to batch.

Pure: times are passed in.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence

from gpusched.core.placement import Cluster


class InteractiveDemand:
    """The peak of interactive demand (GPUs' worth, pending + running) over the last window."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque()  # (time, demand), only when it changed
        self._last = 0.0

    def observe(self, now: float, demand: float) -> None:
        if demand != self._last or not self._samples:
            self._samples.append((now, demand))
            self._last = demand
        while len(self._samples) > 1 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()  # the first kept sample is the level at the window's start

    def export(self) -> list[list[float]]:
        """The samples as plain data, for the store: the headroom a restart keeps (docs/scheduling.md)."""
        return [[at, demand] for at, demand in self._samples]

    def load(self, saved: Sequence[Sequence[float]]) -> None:
        """Restore what `export` gave (before the first observation); pairs that are not numbers are skipped."""
        kept = [(float(e[0]), float(e[1])) for e in saved if isinstance(e, (list, tuple)) and len(e) == 2
                and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in e)]
        if kept:
            self._samples = deque(sorted(kept))
            self._last = self._samples[-1][1]

    def peak(self, now: float) -> float:
        if not self._samples:
            return 0.0
        # The oldest kept sample is the level at the window's start, so a level that dropped to 0
        # more than a window ago is the only sample left.
        return max(d for _, d in self._samples)

    def devices_needed(self, now: float, max_devices: int) -> int:
        peak = self.peak(now)
        return min(max_devices, math.ceil(peak - 1e-9)) if peak > 0 else 0


def choose_headroom(cluster: Cluster, n: int, interactive_on: frozenset[str],
                    ends: Mapping[str, float], forbidden: frozenset[str]) -> frozenset[str]:
    """The n share-capable devices to keep for interactive work.

    Preference: devices already serving interactive jobs, then share-capable ones (interactive
    work is mostly small), then idle ones, then those expected to be free soonest (`ends`: device ->
    latest expected end of what runs there), then the lowest index.
    """
    if n <= 0:
        return frozenset()
    cands = [d for d in cluster.devices.values() if d.uuid not in forbidden]
    cands.sort(key=lambda d: (d.uuid not in interactive_on, not d.shared, not d.idle, ends.get(d.uuid, 0.0),
                              d.gpu_index, d.uuid))
    return frozenset(d.uuid for d in cands[:n])
