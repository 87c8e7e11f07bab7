"""Bring the last pass's Cluster to the next snapshot instead of building a new one.

Between two passes little changes: a few jobs start (the pass committed them already), a few end,
a share is suspended or resumed. Rebuilding every device from the snapshot cost a fifth of a pass.
`sync` rebuilds only the devices whose usage changed, and leaves the others, and the answers the
Cluster memoises (fingerprint, placements, has_room), as they are when nothing changed at all.

The result must be exactly what `Cluster.build` would give, floats included: best fit compares
`used_fraction`s, and a sum taken in another order can differ in the last bit and flip a tie. So
a device is either kept (the jobs on it, in order, are the ones it was built or committed with)
or replayed from empty with the very operations `build` applies (adopt, then pause if yielded),
in the snapshot's order. When that order does not hold for the jobs that stay, or the devices
themselves changed, the caller builds afresh. tests/core/test_cluster_sync.py checks sync against
a fresh build after random sequences of starts, ends, suspensions and reorders.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Set as AbstractSet

from gpusched.core.devices import _Held, precision_class
from gpusched.core.placement import Applied, Cluster
from gpusched.model import ACTIVE_STATES, Job


def sync(cluster: Cluster, active: Iterable[Job], yielded: AbstractSet[int]) -> bool:
    """Make `cluster` equal to `Cluster.build(<its devices>, active, yielded=yielded)`.

    False (cluster left unusable) when it cannot, because the jobs that stay are in another order
    than the cluster applied them; the caller then builds a new one.
    """
    now: list[Applied] = [(job.id, job.allocation, job.uid, job.spec.precision, job.id in yielded)
                          for job in active if job.state in ACTIVE_STATES and job.allocation is not None]
    before = cluster.applied
    if not cluster.dirty and len(now) == len(before) and all(
            a[0] == b[0] and a[1] is b[1] and a[2:] == b[2:] for a, b in zip(now, before, strict=True)):
        return True  # nothing changed: every memo stays valid
    kept = {a[0]: a for a in before}
    same: list[int] = []  # jobs whose usage stays as applied, in snapshot order
    touched: set[str] = set(cluster.dirty)  # devices to replay
    devices = cluster.devices
    for entry in now:
        old = kept.pop(entry[0], None)
        if old is not None and _same(old, entry):
            same.append(entry[0])
            continue
        if old is not None:
            touched.update(u for u in old[1].uuids if u in devices)
        touched.update(u for u in entry[1].uuids if u in devices)
    for old in kept.values():  # ended (or left the snapshot)
        touched.update(u for u in old[1].uuids if u in devices)
    staying = set(same)
    if [a[0] for a in before if a[0] in staying] != same:
        return False  # the jobs that stay were reordered: sums would be taken in another order
    touched &= devices.keys()
    for uuid in touched:
        dev = cluster.writable(uuid)
        dev.holder = None
        dev.holder_prec = None
        dev.clients = {}
        dev.uids = None
        dev.used_fraction = 0.0
        dev.used_mem = 0
        cluster.overcommitted.discard(uuid)
    held: dict[int, _Held] = {}
    old_held = cluster.held
    for jid, alloc, uid, precision, paused in now:
        prev = old_held.get(jid)
        if prev is not None and jid in staying:  # the same allocation: what it holds is as it was
            held[jid] = prev
            uuids = prev.uuids
        else:
            uuids = tuple(u for u in alloc.uuids if u in devices)
            held[jid] = _Held(uuids, alloc.share is not None)
        if not touched:
            continue
        replay = [u for u in uuids if u in touched]
        if replay:
            prec = precision_class(precision)
            for uuid in replay:
                dev = cluster.writable(uuid)
                cluster.adopt_on(dev, jid, alloc, uid, prec, paused)
    cluster.held = held
    cluster.applied = now
    cluster.dirty = set()
    cluster.invalidate(touched)
    return True


def _same(old: Applied, new: Applied) -> bool:
    """The same usage: same allocation (by identity, else by value), uid, precision and pause."""
    return old[2:] == new[2:] and (old[1] is new[1] or old[1] == new[1])
