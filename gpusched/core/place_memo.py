"""What Cluster.place answered, kept as long as it stays true.

A pass asks the same placement question many times (every job of a shape that fits but may not
backfill, every shape that found no room), and the next pass asks most of them again. Answers are
kept until the usage changes; then:
- usage only grew (a commit, a share resumed): a request that found no room still finds none, since
  every fit test only gets harder as devices fill up; answers that found room are dropped;
- usage dropped on some devices (a release, a pause, a device replayed by cluster_sync): a request
  that found no room can now fit only on those devices, so it is asked again there alone (`stale`
  keeps which devices were freed since it failed). That holds for a request that needs one device;
  one for several whole GPUs may combine freed and other idle ones, and is asked afresh.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpusched.model import Allocation

Key = tuple[object, ...]
_STALE_MAX = 1024  # failures waiting to be asked again; past this they are forgotten (asked afresh)


class PlaceMemo:
    """Placement answers by question (see Cluster.place for what a key holds)."""

    __slots__ = ("answers", "stale")

    def __init__(self) -> None:
        self.answers: dict[Key, Allocation | None] = {}
        self.stale: dict[Key, set[str]] = {}  # failed question -> devices freed since it failed

    def grew(self) -> None:
        """Usage was only added: failures hold, answers that found room may not."""
        if self.answers:
            self.answers = {k: a for k, a in self.answers.items() if a is None}

    def freed(self, uuids: Iterable[str] | None) -> None:
        """Usage may have dropped on these devices (None: anywhere, forget everything)."""
        if uuids is None:
            self.answers, self.stale = {}, {}
            return
        devices = set(uuids)
        for since in self.stale.values():
            since |= devices
        for key, answer in self.answers.items():
            if answer is None:
                self.stale[key] = set(devices)
        self.answers = {}
        if len(self.stale) > _STALE_MAX:
            self.stale = {}
