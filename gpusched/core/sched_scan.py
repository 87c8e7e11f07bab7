"""Backfill: once the fairness head is blocked, what of each user's first few jobs may start in a
hole without delaying the head's reserved start, and what is remembered so the next pass asks less.

scheduler.py picks the users in fairness order; `_backfill_user` tries one of them; `_start` commits
a start (the fairness head's too).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, cast

from gpusched.core.actions import Action, StartJob
from gpusched.core.devices import _share_fits
from gpusched.core.placement import Cluster
from gpusched.core.queue import request_fraction
from gpusched.core.sched_core import Candidate, FailMemo, Shapes, UserMemo, Wording, _Active
from gpusched.core.sched_mig import MigMixin
from gpusched.model import Allocation, Job


class ScanMixin(MigMixin):
    """Starting a job, one user's backfill attempt, the backfill rule, parking users that cannot start."""

    def _backfill_user(self, cluster: Cluster, user: str, head_id: int, reserved: frozenset[str],
                       doomed: frozenset[str], fails: set[object], mig_demand: list[str], now: float,
                       actions: list[Action], user_memo: UserMemo) -> int:
        """Start the first of the user's candidates that fits and may backfill; park the user if
        none does. Returns how many candidates it examined.

        Most users, most passes, have nothing that fits: each signature is asked once (in the order
        of its first job, as the job-by-job loop would ask it) and the user is done in bulk. Only
        when some signature fits is the user walked job by job.
        """
        version = self.queue.version(user)
        cands = self._candidates(user, version, head_id)
        excluded = head_id if head_id in self._scan[user][2] else None
        cached = self._shapes.get(user)
        if cached is not None and cached[0] is cands:
            shapes = cached[1]
        else:
            shapes = Shapes.of(cands)
            self._shapes[user] = (cands, shapes)
        refit = self._refit
        for job, sig in shapes.firsts:
            if sig in fails:
                continue
            if refit is not None and sig in refit[0] and not self._may_fit_on(cluster, sig, refit[1], reserved,
                                                                               doomed):
                fails.add(sig)  # failed last pass, and the devices freed since are full again
                continue
            if self._place(cluster, job, reserved, doomed) is not None:
                return self._walk_user(cluster, user, (version, excluded), cands, reserved, doomed, fails,
                                       mig_demand, now, actions, user_memo)
            fails.add(sig)
        self._blocked.update(shapes.blocked)
        room = self.config.max_mig_demand - len(mig_demand)
        if room > 0 and shapes.mig_profiles:
            mig_demand.extend(shapes.mig_profiles[:room])
        user_memo[user] = (version, shapes.sigs, shapes.mig_profiles, excluded)
        self.queue.park(user)
        return len(cands)

    def _still_failing(self, cluster: Cluster, memo: FailMemo) -> frozenset[object]:
        """Of the last pass's failures (under the same reservations and claims), those that cannot
        fit on any device freed since: every other device only filled up, so they fail again.

        After a job ends, the pass would otherwise ask every failed signature of every user again,
        each on the one device that was freed. The others are asked again when their user comes,
        and first only of the freed devices as they are then (`_refit`): a backfill start may
        have filled them meanwhile."""
        freed = cluster.freed_since(memo.mark)
        if freed is None:
            return frozenset()
        self._refit = (memo.fails, freed)
        return frozenset(sig for sig in memo.fails
                         if not self._may_fit_on(cluster, sig, freed, memo.reserved, memo.doomed))

    def _may_fit_on(self, cluster: Cluster, failed: object, uuids: Iterable[str], reserved: frozenset[str],
                    doomed: frozenset[str]) -> bool:
        """Could this signature fit on one of these devices as they are now (what place() would test
        of each; for n whole GPUs, one of them idle and n idle in all)?"""
        sig = cast("tuple[Any, ...]", failed)  # a _signature
        interactive = sig[-1] == "interactive"
        forbidden = doomed if interactive else (reserved | doomed if doomed else reserved)
        kind = sig[0]
        for uuid in uuids:
            d = cluster.devices.get(uuid)
            if d is None or uuid in forbidden:
                continue
            if kind == "s":
                across = self.config.mps_across_users
                if _share_fits(d, sig[1], sig[2], sig[3],
                               any_uid=across == "always" or (across == "interactive" and interactive)):
                    return True
            elif d.idle and (d.kind == "gpu" and cluster.idle_whole() >= sig[1] if kind == "g"
                             else d.kind == "mig" and d.profile == sig[1]):
                return True
        return False

    def _walk_user(self, cluster: Cluster, user: str, seen: tuple[int, int | None], cands: list[Candidate],
                   reserved: frozenset[str], doomed: frozenset[str], fails: set[object], mig_demand: list[str],
                   now: float, actions: list[Action], user_memo: UserMemo) -> int:
        """`_backfill_user` job by job, for a user with something that fits; `seen` is their queue
        version and the head left out of `cands` (for the user memo)."""
        scanned = 0
        tried: set[object] = set()
        wanted: list[str] = []
        for job, sig in cands:
            scanned += 1
            tried.add(sig)
            alloc = None if sig in fails else self._place(cluster, job, reserved, doomed)
            if alloc is None:
                fails.add(sig)
                if sig[0] == "m":  # a MIG request: ("m", profile, class), see _signature
                    profile = str(sig[1])
                    wanted.append(profile)
                    if len(mig_demand) < self.config.max_mig_demand:
                        mig_demand.append(profile)
                self._blocked[job.id] = None
                continue
            ok, why = self._backfill_ok(job, alloc, now)
            if ok:
                actions.append(self._start(cluster, job, alloc, now, str(why)))
                return scanned
            self._blocked[job.id] = why
            tried.add(("backfill", job.id))  # a placement that fits is never a memo hit
        user_memo[user] = (seen[0], frozenset(tried), tuple(wanted), seen[1])
        self.queue.park(user)
        return scanned

    def _start(self, cluster: Cluster, job: Job, alloc: Allocation, now: float, reason: str) -> StartJob:
        """Commit a start: the job holds its devices and its user is charged its commitment at once."""
        cluster.commit(job, alloc)
        self._interactive_pending.pop(job.id, None)
        self._pinned.pop(job.id, None)
        if self._head_id == job.id:
            self._head_id = None
        predicted = self.queue.expected_of(job)
        self.queue.remove(job.id, rekey=False)  # _sync_user below re-keys them, charged
        self._pending_since.pop(job.id, None)
        rec = _Active(job.user, job.uid, alloc.compute_fraction, now, True, job.spec.requeue, now, job, alloc,
                      predicted)
        rec.committed = self.fair.commitment(request_fraction(job.spec.request), predicted)
        self._active[job.id] = rec
        self._count_running(rec, +1)
        self.fair.charge(job.user, 0.0, virtual_gpu_s=rec.committed)
        self._outstanding(job.user, rec.committed)
        self._sync_user(job.user)
        return StartJob(job.id, alloc, reason, predicted)

    def _backfill_ok(self, job: Job, alloc: Allocation, now: float) -> tuple[bool, str | Wording]:
        """May `job` start in a hole without delaying the fairness head's reserved start?"""
        res = self._head_reservation()
        if res is None:
            return True, self._fair_reason(job)
        limit = job.spec.time_limit_s
        if not res.served_by_ends:
            return True, f"backfill: job {res.job_id}, next by fairness, does not wait for running jobs"
        if not (set(alloc.uuids) & res.uuids):
            return True, f"backfill: uses no device reserved for job {res.job_id}"
        head_waited = now - self._pending_since.get(res.job_id, now)
        if head_waited < self.config.reserve_after_s:
            return True, (f"backfill: job {res.job_id}, next by fairness, has waited {head_waited:.0f} s, less than "
                          f"reserve_after_s = {self.config.reserve_after_s:.0f} s")
        if math.isfinite(res.at):
            if limit is not None and now + limit <= res.at:
                return True, f"backfill: time limit ends before job {res.job_id}'s reserved start"
            expected = self.queue.expected_of(job)
            if now + expected <= res.at:
                return True, (f"backfill: expected to end ({expected:.0f} s) before job {res.job_id}'s reserved "
                              f"start in {res.at - now:.0f} s")
            # worded only if someone asks (sched_core.Wording): most passes reject these again
            return False, Wording("would delay job {}, next by fairness, reserved to start in {:.0f} s",
                                  (res.job_id, res.at - now))
        if limit is not None and limit <= self.config.backfill_unknown_horizon_s:
            return True, (f"backfill: job {res.job_id}'s start is unknown; time limit within "
                          f"{self.config.backfill_unknown_horizon_s:.0f} s")
        return False, Wording("waiting behind job {}, next by fairness (only jobs with a time limit <= {:.0f} s "
                              "may backfill)", (res.job_id, self.config.backfill_unknown_horizon_s))

    def _park_remembered(self, head: Job, fails: set[object], user_memo: UserMemo, mig_demand: list[str]) -> None:
        """Park, in one sweep, every user whose candidates all failed last pass with nothing freed
        or queued for them since; picking them one by one would rescan the order for each (O(u^2))."""
        for user in self.queue.users():
            if user != head.user:
                self._park_if_remembered(user, fails, user_memo, mig_demand, head.id)

    def _park_if_remembered(self, user: str, fails: set[object], user_memo: UserMemo, mig_demand: list[str],
                            head_id: int) -> bool:
        """Park the user if everything of theirs this pass would try failed last pass, and nothing
        has been freed or queued for them since (their explanations from then still hold)."""
        memo = self._user_memo.get(user)
        version = self.queue.version(user)
        if memo is None or memo[0] != version or not memo[1] <= fails:
            return False
        self._candidates(user, version, head_id)  # brings their window (_scan) to this version
        if memo[3] != (head_id if head_id in self._scan[user][2] else None):
            # another head is left out of their candidates than then: leaving one out brings in the
            # job after their window, so the candidates are not those that were tried
            return False
        user_memo[user] = memo
        for profile in memo[2]:  # their blocked MIG jobs still count as creation demand
            if len(mig_demand) < self.config.max_mig_demand:
                mig_demand.append(profile)
        self.queue.park(user)
        return True
