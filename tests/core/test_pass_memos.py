"""The memos a pass keeps from the last one give what the plain computation gives, pass after pass.

A scheduler that checks itself: every time it uses its kept placement view, reservation, a user's
deadline or a user's backfill candidates, the test recomputes it from scratch and compares. A
random mixed workload (whole GPUs, shares on MPS and timeslice devices, MIG, time limits, job ends,
preemption) runs through the engine stand-in, so the memos see starts, ends, suspensions and new
estimates between passes.
"""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpusched.core
from gpusched.core.actions import Action
from gpusched.core.placement import Cluster
from gpusched.core.preempt import Candidate as PreemptCandidate
from gpusched.core.preempt import choose_victims
from gpusched.core.sched_core import Candidate, UserMemo, _Reservation, _signature
from gpusched.core.scheduler import Scheduler, SchedulerConfig, Snapshot
from gpusched.model import Job, JobState, ShareRequest, WholeRequest

from .helpers import Node, gpu, instance, job
from .test_cluster_sync import state

# Compiled classes cannot be subclassed: on the compiled core, tests/core/test_native.py runs this
# file on the pure-Python one.
pytestmark = pytest.mark.skipif(gpusched.core.NATIVE, reason="subclasses the scheduler; run on the pure-Python "
                                "core by tests/core/test_native.py")


class CheckedScheduler(Scheduler):
    """Asserts each kept answer against a fresh one."""

    checks = 0
    fail_checks = 0
    hopeless_checks = 0
    share_hopeless_checks = 0
    released_share_checks = 0  # ... with a share among the candidates that would be released
    park_checks = 0
    _asked_under: tuple[Cluster, frozenset[str], frozenset[str]]

    def _cluster_for(self, snapshot: Snapshot) -> Cluster:
        kept = super()._cluster_for(snapshot)
        fresh = Cluster.build(snapshot.gpus, snapshot.active, share_modes=snapshot.share_modes,
                              unschedulable=snapshot.unschedulable, mps_owner=snapshot.mps_owner,
                              yielded=snapshot.yielded)
        assert state(kept, ask=False) == state(fresh, ask=False)
        CheckedScheduler.checks += 1
        return kept

    def _reserve(self, cluster: Cluster, job: Job, now: float, reserved: frozenset[str],
                 fingerprint: tuple[object, ...]) -> _Reservation:
        got = super()._reserve(cluster, job, now, reserved, fingerprint)
        memo, self._reserve_memo = self._reserve_memo, None
        fresh = super()._reserve(cluster, job, now, reserved, fingerprint)
        self._reserve_memo = memo
        assert (got.job_id, got.at, got.uuids, got.served_by_ends) == (
            fresh.job_id, fresh.at, fresh.uuids, fresh.served_by_ends)
        return got

    def _reserve_fresh(self, cluster: Cluster, job: Job, reserved: frozenset[str],
                       ends: list[tuple[float, int]]) -> tuple[int | None, frozenset[str]]:
        got = super()._reserve_fresh(cluster, job, reserved, ends)
        assert got == self._reference_reserve(cluster, job, reserved, ends)
        return got

    def _reference_reserve(self, cluster: Cluster, job: Job, reserved: frozenset[str],
                           ends: list[tuple[float, int]]) -> tuple[int | None, frozenset[str]]:
        """The plain computation: release job after job on a copy and ask after each release
        (a one-device request only on the devices released so far, as reserved for the others)."""
        sim = cluster.copy()
        single = not isinstance(job.spec.request, WholeRequest) or job.spec.request.gpus <= 1
        everything = frozenset(sim.devices)
        freed: set[str] = set()
        for index, (_, jid) in enumerate(ends):
            freed.update(sim.devices_of(jid))
            sim.release(jid)
            alloc = self._place(sim, job, reserved | (everything - freed) if single else reserved)
            if alloc is not None:
                return index, frozenset(alloc.uuids)
        return None, frozenset()

    def _candidates(self, user: str, version: int, head_id: int) -> list[Candidate]:
        got = super()._candidates(user, version, head_id)
        fresh = [(j, _signature(j)) for j in self.queue.jobs_of(user) if j.id != head_id][: self.config.per_user_scan]
        assert [(j.id, s) for j, s in got] == [(j.id, s) for j, s in fresh]
        return got

    def _backfill_user(self, cluster: Cluster, user: str, head_id: int, reserved: frozenset[str],
                       doomed: frozenset[str], fails: set[object], mig_demand: list[str], now: float,
                       actions: list[Action], user_memo: UserMemo) -> int:
        # every signature taken as failed (asked this pass, or kept from the last one by
        # _still_failing) finds no room when asked afresh, on a copy that memoises nothing
        fresh = cluster.copy()
        for cand_job, sig in self._candidates(user, self.queue.version(user), head_id):
            if sig in fails and cand_job.id not in self._pinned:
                assert self._place(fresh, cand_job, reserved, doomed) is None, (cand_job.id, sig)
                CheckedScheduler.fail_checks += 1
        return super()._backfill_user(cluster, user, head_id, reserved, doomed, fails, mig_demand, now,
                                      actions, user_memo)

    def _park_remembered(self, head: Job, fails: set[object], user_memo: UserMemo, mig_demand: list[str]) -> None:
        assert self._reserve_args is not None  # set when the head blocked, just before this
        self._asked_under = (self._reserve_args[0], self._reserve_args[3], self._reserve_args[5])
        super()._park_remembered(head, fails, user_memo, mig_demand)

    def _park_if_remembered(self, user: str, fails: set[object], user_memo: UserMemo, mig_demand: list[str],
                            head_id: int) -> bool:
        parked = super()._park_if_remembered(user, fails, user_memo, mig_demand, head_id)
        if parked:  # parked on last pass's word: nothing of theirs fits, asked afresh
            cluster, reserved, doomed = self._asked_under
            fresh = cluster.copy()
            for cand_job, _ in self._candidates(user, self.queue.version(user), head_id):
                if cand_job.id not in self._pinned:
                    assert self._place(fresh, cand_job, reserved, doomed) is None, (user, cand_job.id)
            CheckedScheduler.park_checks += 1
        return parked

    def _hopeless(self, cluster: Cluster, job: Job, cands: list[PreemptCandidate],
                  reserved: frozenset[str]) -> bool:
        got = super()._hopeless(cluster, job, cands, reserved)
        if got:  # the search it spares would have found nothing
            assert choose_victims(cluster, cands, lambda sim: self._place(sim, job, reserved) is not None) is None
            CheckedScheduler.hopeless_checks += 1
            if isinstance(job.spec.request, ShareRequest):
                CheckedScheduler.share_hopeless_checks += 1
                shares = {c.job_id for c in cands if c.mode != "suspend" and c.job_id in cluster.held
                          and cluster.held[c.job_id].shared}
                CheckedScheduler.released_share_checks += bool(shares)
        return got

    def _sync_user(self, user: str) -> None:
        super()._sync_user(user)
        head = self.queue.head(user)
        if head is not None:  # the key it was filed under is the deadline computed afresh
            assert self.queue._users[user].key == (self.queue._deadline(user, head, self.fair.v(user)), user)


@settings(max_examples=12, deadline=None)
@given(st.integers(0, 10**6), st.booleans())
def test_kept_answers_equal_fresh_ones_through_a_random_workload(seed: int, suspend: bool) -> None:
    run_workload(seed, suspend)


def test_the_workload_reaches_kept_failures_and_hopeless_searches() -> None:
    """The checks above are not vacuous: seeds like these reach every shortcut."""
    before = (CheckedScheduler.fail_checks, CheckedScheduler.hopeless_checks, CheckedScheduler.park_checks,
              CheckedScheduler.share_hopeless_checks, CheckedScheduler.released_share_checks)
    for seed in range(4):
        run_workload(seed, suspend=seed % 2 == 0)  # without suspending, shares are requeued: released
    assert CheckedScheduler.fail_checks > before[0]
    assert CheckedScheduler.hopeless_checks > before[1]
    assert CheckedScheduler.park_checks > before[2]
    assert CheckedScheduler.share_hopeless_checks > before[3]
    assert CheckedScheduler.released_share_checks > before[4]


def run_workload(seed: int, suspend: bool = True) -> None:
    rnd = random.Random(seed)
    mig = (instance(3, "3g.40gb", 0), instance(3, "2g.20gb", 4), instance(3, "1g.10gb", 6))
    gpus = [gpu(0, numa=0), gpu(1, numa=0), gpu(2, numa=1), gpu(3, mig=True, instances=mig, numa=1)]
    modes = {"GPU-0001": "mps", "GPU-0002": "timeslice", mig[0].uuid: "mps"}
    cfg = SchedulerConfig(preempt_after_s=300.0, preempt_min_run_s=60.0, preempt_min_gain_s=0.0,
                          preempt_lag_margin_gpu_s=0.0, per_user_scan=3,  # short windows: heads shift them
                          preempt_suspend_shares=suspend)
    node = Node(CheckedScheduler(cfg, incremental=True), gpus, share_modes=modes)
    ids = itertools.count(1)
    learned: set[int] = set()

    def learn(nd: Node) -> None:  # a job ended: the estimator learns its run time, as in the engine
        for jid, j in nd.done.items():
            if jid not in learned:
                learned.add(jid)
                nd.sched.observe_end(j.model_copy(update={"state": JobState.COMPLETED, "ended_at": nd.now}))

    for t in range(0, 40_000, 2000):
        for _ in range(rnd.randrange(6)):
            user = f"u{rnd.randrange(4)}"
            kind = rnd.randrange(4)
            limit = rnd.choice([None, 3000.0, 20000.0])
            if kind == 0:
                j = job(next(ids), user, gpus=rnd.choice([1, 2, 3]), time_limit=limit, requeue=rnd.random() < 0.5)
            elif kind == 1:
                j = job(next(ids), user, mig=rnd.choice(["1g.10gb", "2g.20gb", "3g.40gb"]), time_limit=limit)
            else:
                j = job(next(ids), user, share=rnd.choice([0.2, 0.3, 0.5]), mem=rnd.choice([4096, 20000]),
                        time_limit=limit, precision=rnd.choice([None, "bf16", "fp32"]),
                        job_class="interactive" if rnd.random() < 0.2 else "batch", requeue=rnd.random() < 0.3)
            node.submit(j, rnd.uniform(300, 30000))
        node.run_until(float(t + 2000), on_tick=learn)
    assert CheckedScheduler.checks > 0 and node.done  # it ran, and jobs came and went

