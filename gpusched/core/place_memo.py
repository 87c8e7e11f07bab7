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

from collections.abc import Callable, Iterable

from gpusched.model import Allocation

Key = tuple[object, ...]
_LOG_MAX = 64  # frees remembered; past this, failures waiting to be asked again are forgotten (asked afresh)


class PlaceMemo:
    """Placement answers by question (see Cluster.place for what a key holds)."""

    __slots__ = ("answers", "log", "stale")

    def __init__(self) -> None:
        self.answers: dict[Key, Allocation | None] = {}
        # failed question -> index in `log` from which on the frees since it failed are
        self.stale: dict[Key, int] = {}
        self.log: list[frozenset[str]] = []  # the devices of each free, oldest first

    def grew(self) -> None:
        """Usage was only added: failures hold, answers that found room may not."""
        if self.answers:
            self.answers = {k: a for k, a in self.answers.items() if a is None}

    def freed(self, uuids: Iterable[str] | None, helps: Callable[[Key], bool] | None = None) -> None:
        """Usage may have dropped on these devices (None: anywhere, forget everything). `helps`
        says which failed questions such devices could answer at all (default: every one): the
        others keep their answer (a share never goes on a device that is not shared, say)."""
        if uuids is None or len(self.log) >= _LOG_MAX:
            self.stale, self.log = {}, []
            if uuids is None:
                self.answers = {}
                return
        epoch = len(self.log)
        kept: dict[Key, Allocation | None] = {}
        for key, answer in self.answers.items():
            if answer is None:
                if helps is None or helps(key):
                    self.stale[key] = epoch
                else:
                    kept[key] = None
        self.answers = kept
        self.log.append(frozenset(uuids))

    def freed_since(self, key: Key) -> frozenset[str] | None:
        """For a question that failed before the last frees: the devices freed since (None if it
        is not such a question). Forgets it: the caller asks again and records the answer."""
        epoch = self.stale.pop(key, None)
        if epoch is None:
            return None
        log = self.log
        return log[epoch] if epoch == len(log) - 1 else frozenset().union(*log[epoch:])
