"""What Cluster.place answered, kept as long as it stays true.

A pass asks the same placement question many times (every job of a shape that fits but may not
backfill, every shape that found no room), and the next pass asks most of them again. Answers are
kept until the usage changes; then:
- usage only grew (a commit, a share resumed): a request that found no room still finds none, since
  every fit test only gets harder as devices fill up; answers that found room are dropped;
- usage dropped on some devices (a release, a pause, a device replayed by cluster_sync): a request
  that found no room can now fit only on those devices, so it is asked again there alone. That
  holds for a request that needs one device; one for several whole GPUs may combine freed and other
  idle ones, and is asked afresh.

A free costs O(1): it is logged with the kinds of request its devices could take at all (a share
never goes on a device that is not shared, say), and a failure is checked against the frees logged
since it failed only when it is asked again. Rebuilding the table on every free cost a tenth of a
pass once a few hundred questions had failed.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpusched.model import Allocation

Key = tuple[object, ...]
_LOG_MAX = 64  # frees remembered; past this, every failure is forgotten (asked afresh), and older marks


def kind_of(key: Key) -> object:
    """Which kind of device a question can be answered on: "s" (shared), "g" (whole GPU), or
    ("m", profile) for a MIG profile (see Cluster.place for what a key holds)."""
    kind = key[0]
    return ("m", key[1]) if kind == "m" else kind


class PlaceMemo:
    """Placement answers by question (see Cluster.place for what a key holds)."""

    __slots__ = ("base", "failed", "found", "helped", "log")

    def __init__(self) -> None:
        self.found: dict[Key, Allocation] = {}  # questions that found room, until any change
        self.failed: dict[Key, int] = {}  # question that found no room -> the log position then
        # each free since `base`: its devices and the kinds of question they could answer
        self.log: list[tuple[frozenset[str], frozenset[object]]] = []
        self.base = 0  # log positions before this were forgotten
        self.helped: dict[object, int] = {}  # kind -> position of the latest free that could help it

    def grew(self) -> None:
        """Usage was only added: failures hold, answers that found room may not."""
        if self.found:
            self.found = {}

    def freed(self, uuids: Iterable[str] | None, kinds: frozenset[object] = frozenset()) -> None:
        """Usage may have dropped on these devices (None: anywhere, forget everything), which can
        take questions of these `kinds` (kind_of) only."""
        if self.found:
            self.found = {}
        if uuids is None or len(self.log) >= _LOG_MAX:
            self.failed = {}
            self.base += len(self.log) + 1  # marks from before now read as unknown
            self.log = []
            if uuids is None:
                return
        at = self.base + len(self.log)
        for kind in kinds:
            self.helped[kind] = at
        self.log.append((frozenset(uuids), kinds))

    def lookup(self, key: Key) -> tuple[bool, Allocation | None, frozenset[str] | None]:
        """(known, answer, devices to ask on). Known: the kept Allocation, or None when it found no
        room and nothing freed since could help. Not known: ask on the devices freed since it failed
        (frees that could help it), or, when those are None, everywhere; then `record` the answer."""
        alloc = self.found.get(key)
        if alloc is not None:
            return True, alloc, None
        at = self.failed.get(key)
        if at is None:
            return False, None, None
        kind = kind_of(key)
        if self.helped.get(kind, -1) < at:
            return True, None, None  # nothing freed since it failed could take it
        got = [uuids for uuids, kinds in self.log[at - self.base:] if kind in kinds]
        return False, None, got[0] if len(got) == 1 else frozenset().union(*got)

    def mark(self) -> int:
        """Where the log stands now, for `freed_since`."""
        return self.base + len(self.log)

    def freed_since(self, mark: int) -> frozenset[str] | None:
        """Every device freed since `mark`, whatever it could take; None if forgotten."""
        if mark < self.base:
            return None
        since = self.log[mark - self.base:]
        if len(since) == 1:
            return since[0][0]
        return frozenset().union(*(uuids for uuids, _ in since))

    def record(self, key: Key, alloc: Allocation | None) -> None:
        if alloc is None:
            self.failed[key] = self.base + len(self.log)
        else:
            self.found[key] = alloc
            self.failed.pop(key, None)
