"""The fairness head's reservation: when would it fit, releasing running jobs in order of their
expected end, and on which devices (backfill must not take them; scheduler.py)."""

from __future__ import annotations

import math

from gpusched.core.placement import Cluster
from gpusched.core.sched_core import SchedulerCore, _Reservation
from gpusched.model import Job, PartitionRequest, WholeRequest


class ReservationMixin(SchedulerCore):
    """The head's reservation, memoised by what decides it."""

    def _head_reservation(self) -> _Reservation | None:
        """The blocked head's reservation this pass, worked out on first read.

        Many passes never read it (nothing fits to backfill, and preemption is not due or is ruled
        out by cheaper tests first), and working it out is the dearest part of a blocked head.
        Reading it later gives what reading it when the head blocked would: the view does not change
        before the first backfill start, which reads it first.
        """
        args = self._reserve_args
        if args is not None:
            self._reserve_args = None
            cluster, job, now, reserved, fingerprint, doomed = args
            res = self._reserve(cluster, job, now, reserved, fingerprint)
            if doomed:
                res.uuids = res.uuids | doomed
            self._reservation = res
        return self._reservation

    def _reserve(self, cluster: Cluster, job: Job, now: float, reserved: frozenset[str],
                 fingerprint: tuple[object, ...]) -> _Reservation:
        """When would the blocked head fit, releasing active jobs in order of their expected end?

        Which release lets the head fit depends only on the head, what is held (by whom), the
        reserved devices and the *order* of the expected ends, not on their values: those move
        every pass for jobs running past their estimate (never below k x elapsed). So the memo
        keeps the index of that release and the start is re-read from this pass's ends.
        """
        ends = sorted((self._expected_end(rec, now) if jid not in self._preempting else now, jid)
                      for jid, rec in self._active.items() if jid in cluster.held)
        held = cluster.held
        key = (job.id, fingerprint, reserved, self._pinned.get(job.id), tuple((jid, held[jid]) for _, jid in ends))
        cached = self._reserve_memo
        if cached is not None and cached[0] == key:
            index, uuids = cached[1]
        else:
            index, uuids = self._reserve_fresh(cluster, job, reserved, ends)
            self._reserve_memo = (key, (index, uuids))
        if index is None:
            return _Reservation(job.id, math.inf, frozenset(), served_by_ends=False)
        return _Reservation(job.id, max(ends[index][0], now), uuids)

    def _reserve_fresh(self, cluster: Cluster, job: Job, reserved: frozenset[str],
                       ends: list[tuple[float, int]]) -> tuple[int | None, frozenset[str]]:
        """(index in `ends` of the release after which the head fits, the devices it gets), or
        (None, empty) if no release helps."""
        need_whole = job.spec.request.gpus if isinstance(job.spec.request, WholeRequest) else 0
        if need_whole > 1:  # the same answer as the loop below, read off who holds each GPU
            found = cluster.whole_after_releases(need_whole, self._forbidden(cluster, job, reserved),
                                                 [jid for _, jid in ends])
            return (found[0], frozenset(d.uuid for d in found[1])) if found is not None else (None, frozenset())
        sim = cluster.copy()
        # A one-device request that does not fit now can fit only on a device a release touched, and
        # after the release of one job only on that job's devices: every other device is as it was
        # when the request last failed on it (a 1g job, once 30 jobs end one by one, is 30 placements
        # on one device each, not 30 full ones).
        for index, (_, jid) in enumerate(ends):
            touched = sim.devices_of(jid)
            sim.release(jid)
            req = job.spec.request
            many = isinstance(req, PartitionRequest) and req.gpus > 1  # may need several releases' devices
            alloc = self._place(sim, job, reserved, only=None if many else touched)
            if alloc is not None:
                return index, frozenset(alloc.uuids)
        return None, frozenset()
