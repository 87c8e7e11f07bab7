"""Scheduler: fair shares over long runs, backfill, preemption, dynamic MIG, failures, explainability."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpusched.core.fairshare import FairnessConfig
from gpusched.core.migplan import MigPolicy
from gpusched.core.placement import Cluster
from gpusched.core.scheduler import (
    CreateInstance,
    FailJob,
    FifoScheduler,
    PreemptJob,
    ResumeJob,
    Scheduler,
    SchedulerConfig,
    SetMigMode,
    Snapshot,
    StartJob,
)
from gpusched.model import JobState

from .helpers import Node, gpu, instance, job


def _starts(actions: Sequence[object]) -> list[int]:
    return [a.job_id for a in actions if isinstance(a, StartJob)]


def test_fifo_scheduler_is_kept() -> None:
    snap = Snapshot(gpus=(gpu(0),), pending=(job(1), job(2)), active=())
    acts = FifoScheduler().plan(snap, 0.0)
    assert [a.job_id for a in acts if isinstance(a, StartJob)] == [1]


@pytest.mark.parametrize("incremental", [False, True])
def test_unsatisfiable_jobs_fail_with_what_the_node_has(incremental: bool) -> None:
    n = Node(Scheduler(incremental=incremental), [gpu(0)])
    n.submit(job(1, share=0.5), 10)
    n.submit(job(2, gpus=2), 10)
    n.submit(job(3), 10)
    acts = n.step()
    fails = {a.job_id: a.reason for a in acts if isinstance(a, FailJob)}
    assert set(fails) == {1, 2}
    assert "mps or timeslice" in fails[1] and "1 GPU(s) with MIG off" in fails[2]
    assert _starts(acts) == [3]


def test_jobs_sharing_a_request_object_are_judged_against_the_node_as_it_is_now() -> None:
    """`_unsat` keeps its last answer by the request object's identity (a sweep's jobs share one): a
    node that changed shape in between must be asked again, not answered from before."""
    sched = Scheduler(incremental=True)
    two, one = (gpu(0), gpu(1)), (gpu(0),)
    first = job(1, gpus=2)
    second = first.model_copy(update={"id": 2})  # the same spec object, so the same request object
    assert second.spec.request is first.spec.request
    sched.plan(Snapshot(gpus=one, pending=(), active=()), 0.0)
    sched.submit(first)
    fails = [a for a in sched.plan(Snapshot(gpus=one, pending=(), active=()), 1.0) if isinstance(a, FailJob)]
    assert [a.job_id for a in fails] == [1]
    sched.remove(1)
    sched.plan(Snapshot(gpus=two, pending=(), active=()), 2.0)  # a second GPU: a new node shape
    sched.submit(second)
    acts = sched.plan(Snapshot(gpus=two, pending=(), active=()), 3.0)
    assert not [a for a in acts if isinstance(a, FailJob)] and _starts(acts) == [2]


def _backlogged_run(weights: dict[str, int], hours: float, incremental: bool = True,
                    on_tick: object = None) -> tuple[Node, dict[str, float]]:
    cfg = SchedulerConfig(fairness=FairnessConfig(weights=weights))
    n = Node(Scheduler(cfg, incremental=incremental), [gpu(i, numa=i // 4) for i in range(8)])
    r = random.Random(7)
    jid = 1
    per_user = int(8 * hours * 3600 / 1800) + 50  # more work than the node can do
    for u in weights:
        for _ in range(per_user):
            n.submit(job(jid, u, gpus=r.choice([1, 1, 1, 2])), r.uniform(300, 3300))
            jid += 1
    n.run_until(hours * 3600, on_tick=on_tick)
    return n, n.service_until_now()


def test_backlogged_users_get_their_weight_share_within_5_percent() -> None:
    weights = {"alice": 300, "bob": 200, "carol": 100, "dave": 100}
    lags: list[float] = []
    _, served = _backlogged_run(weights, 60, on_tick=lambda nd: lags.append(
        max(abs(nd.sched.fair.lag(u)) for u in weights)))
    total = sum(served.values())
    for u, w in weights.items():
        want = w / sum(weights.values())
        assert abs(served[u] / total - want) <= 0.05 * want, (u, served[u] / total, want)
    # lag bound: never more than one maximal job (2 GPUs x 3300 s) per GPU pair in flight
    assert max(lags) <= 8 * 3300 / 2


def test_interactive_job_goes_first_without_more_share() -> None:
    s = Scheduler(incremental=True)
    n = Node(s, [gpu(0)])
    n.submit(job(1, "alice"), 100)
    n.submit(job(2, "bob"), 100)
    n.submit(job(3, "carol", job_class="interactive"), 100)
    assert _starts(n.step()) == [3]


def test_nice_orders_a_users_own_jobs() -> None:
    n = Node(Scheduler(incremental=True), [gpu(0)])
    n.submit(job(1, "alice", nice=5), 100)
    n.submit(job(2, "alice", nice=0), 100)
    assert _starts(n.step()) == [2]


def _head_blocked_node(**cfg: object) -> Node:
    # alice's weight makes her 8-GPU request the earliest deadline: the fairness head
    fair = FairnessConfig(weights={"alice": 10_000})
    s = Scheduler(SchedulerConfig(fairness=fair, **cfg), incremental=True)  # type: ignore[arg-type]
    n = Node(s, [gpu(i) for i in range(8)])
    for k in range(4):  # four single-GPU jobs with limits, ending at t=1000
        n.submit(job(10 + k, "zed", time_limit=1000), 1000)
    n.step()
    n.submit(job(1, "alice", gpus=8), 100)  # the fairness head: needs all 8
    return n


def test_backfill_only_into_holes_that_end_before_the_reserved_start() -> None:
    n = _head_blocked_node()
    n.now = 10
    n.submit(job(2, "bob", time_limit=500), 500)  # ends at 510 < 1000: fits the hole
    n.submit(job(3, "carol", time_limit=5000), 5000)  # would delay the head
    n.submit(job(4, "dave"), 5000)  # no limit: would delay the head
    started = _starts(n.step())
    assert started == [2]
    text = n.sched.explain(3)
    assert "would delay job 1" in text and "ahead by fairness" in text
    assert "next by fairness" in n.sched.explain(1)
    n.run_until(1000)
    assert 1 in n.active  # the head started on time


def test_the_heads_own_user_backfills_onto_devices_the_head_cannot_use() -> None:
    """A user's MIG job must not idle a free instance behind that user's blocked whole-GPU job."""
    s = Scheduler(SchedulerConfig(), incremental=True)
    n = Node(s, [gpu(0), gpu(1, mig=True, instances=(instance(1, "3g.40gb", 4),))])
    n.submit(job(1, "alice", gpus=1), 1000)  # takes the only whole GPU
    assert _starts(n.step()) == [1]
    n.submit(job(2, "alice", gpus=1), 100)  # alice's head: blocked until job 1 ends
    n.submit(job(3, "alice", mig="3g.40gb"), 100)  # fits the idle instance now
    assert _starts(n.step()) == [3]
    assert "next by fairness" in n.sched.explain(2)


def _untimed_head_node(reserve_after_s: float) -> Node:
    """GPU 0 runs an untimed job; alice's 2-GPU head can only start after it, at its estimated end."""
    fair = FairnessConfig(weights={"alice": 10_000})
    s = Scheduler(SchedulerConfig(fairness=fair, reserve_after_s=reserve_after_s), incremental=True)
    n = Node(s, [gpu(0), gpu(1)])
    n.submit(job(10, "zed"), 100_000)  # no time limit: nobody knows when GPU 0 frees up
    n.step()
    n.submit(job(1, "alice", gpus=2), 100)
    return n


def test_strict_reservation_keeps_untimed_jobs_off_the_heads_devices() -> None:
    n = _untimed_head_node(reserve_after_s=0)
    n.now = 10
    n.submit(job(2, "bob"), 50)  # no time limit: could hold GPU 1 for ever
    assert _starts(n.step()) == []
    # Nothing is known of job 10 or job 2: both are expected to run the default estimate, so job 2
    # would still hold GPU 1 when GPU 0 is expected to free up.
    assert "would delay job 1" in n.sched.explain(2)


def test_reserve_after_lets_untimed_jobs_backfill_until_the_head_has_waited_long_enough() -> None:
    n = _untimed_head_node(reserve_after_s=600)
    n.now = 10
    n.submit(job(2, "bob"), 50)
    assert _starts(n.step()) == [2]  # the head has waited 10 s < 600 s: GPU 1 is not left idle
    n.run_until(700)  # job 2 ended at 60; the head has now waited 700 s
    n.submit(job(3, "bob"), 50)
    assert _starts(n.step()) == []  # now the reservation holds
    assert "would delay job 1" in n.sched.explain(3)


def test_no_backfill_when_disabled() -> None:
    n = _head_blocked_node(backfill=False)
    n.submit(job(2, "bob", time_limit=500), 500)  # the hole that backfill fills in the test above
    assert _starts(n.step()) == []


def _trainer_then_interactive() -> Node:
    """Bob's two requeueable jobs hold both GPUs for an hour (well above his share); then alice's
    interactive job arrives."""
    cfg = SchedulerConfig(preempt_after_s=600, preempt_min_gain_s=60, preempt_lag_margin_gpu_s=300,
                          interactive_preempt_after_s=600)
    n = Node(Scheduler(cfg, incremental=True), [gpu(0), gpu(1)])
    n.submit(job(1, "bob", requeue=True), 10_000)
    n.submit(job(2, "bob", requeue=True), 10_000)
    n.step()
    n.now = 3600
    n.submit(job(3, "alice", job_class="interactive"), 100)
    return n


def test_preemption_serves_a_long_waiting_interactive_job() -> None:
    n = _trainer_then_interactive()
    assert not [a for a in n.step() if isinstance(a, PreemptJob)]  # not waited long enough
    n.now = 3600 + 601
    acts = n.step()
    pre = [a for a in acts if isinstance(a, PreemptJob)]
    assert len(pre) == 1 and "above share" in pre[0].reason
    assert 3 in n.active  # started on the re-plan after the preempted job left
    assert pre[0].job_id in n.pending  # requeued


def test_no_preemption_of_jobs_that_did_not_ask_for_requeue() -> None:
    cfg = SchedulerConfig(preempt_after_s=600, preempt_min_gain_s=60, preempt_lag_margin_gpu_s=300)
    n = Node(Scheduler(cfg, incremental=True), [gpu(0)])
    n.submit(job(1, "bob"), 100_000)
    n.step()
    n.now = 3600
    n.submit(job(2, "alice", job_class="interactive"), 100)
    n.now = 10_000
    assert not [a for a in n.step() if isinstance(a, PreemptJob)]


def test_dynamic_mig_creates_the_instance_then_starts_the_job() -> None:
    cfg = SchedulerConfig(mig=MigPolicy(min_idle_s=60, min_reconfig_interval_s=0))
    n = Node(Scheduler(cfg, incremental=True), [gpu(0, mig=True)], dynamic=frozenset({0}))
    n.submit(job(1, mig="3g.40gb"), 100)
    acts = n.step()
    assert [a for a in acts if isinstance(a, CreateInstance)]
    assert 1 in n.active
    # later demand for a 7g: the idle 3g must have been idle 60 s first
    n.run_until(130)  # job 1 ended at 100: the 3g has been idle for 30 s
    n.submit(job(2, mig="7g.80gb"), 100)
    n.step()
    assert 2 not in n.active
    assert "waiting for a free 7g.80gb" in n.sched.explain(2)
    n.now = 170
    n.step()
    assert 2 in n.active


def test_fairness_order_interleaves_users_by_weight() -> None:
    cfg = SchedulerConfig(fairness=FairnessConfig(weights={"alice": 200}))
    s = Scheduler(cfg, incremental=True)
    for k in range(6):
        s.submit(job(k + 1, "alice"))
        s.submit(job(k + 101, "bob"))
    order = s.fairness_order()
    first6 = order[:6]
    assert sum(1 for j in first6 if j < 100) == 4  # 2:1


def test_standing_survives_a_restart() -> None:
    n, _ = _backlogged_run({"alice": 100, "bob": 100}, 2)
    saved = n.sched.export_standing()
    fresh = Scheduler()
    fresh.load_standing(saved)
    assert fresh.export_standing()["alice"]["service"] == saved["alice"]["service"]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_no_starvation_under_bounded_arrivals(seed: int) -> None:
    r = random.Random(seed)
    n = Node(Scheduler(incremental=bool(seed % 2)), [gpu(i, numa=i // 2) for i in range(4)])
    jid = 1
    t = 0.0
    while t < 20_000:
        t += r.expovariate(1 / 300)
        n.run_until(t)
        big = r.random() < 0.1
        limit = r.choice([None, 1800.0, 600.0])
        n.submit(job(jid, r.choice("abcd"), gpus=4 if big else r.choice([1, 1, 2]), time_limit=limit),
                 min(limit or 1e9, r.uniform(60, 1800)))
        jid += 1
    n.run_until(10**7)
    assert not n.pending, sorted(n.pending)
    assert len(n.done) == jid - 1


_job = st.tuples(
    st.sampled_from(["a", "b", "c"]),
    st.one_of(st.builds(lambda k: {"gpus": k}, st.integers(1, 2)),
              st.builds(lambda p: {"mig": p}, st.sampled_from(["1g.10gb", "2g.20gb", "3g.40gb", "7g.80gb"])),
              st.builds(lambda f, m: {"share": f, "mem": m}, st.sampled_from([0.1, 0.25, 0.5, 1.0]),
                        st.integers(100, 50_000))),
    st.floats(10, 5000),
    st.sampled_from([None, 100.0, 3000.0]),
    st.booleans(),
)


@settings(max_examples=25, deadline=None)
@given(jobs=st.lists(_job, min_size=1, max_size=25), gap=st.floats(1, 500))
def test_no_over_allocation_and_valid_mig_under_random_workloads(
    jobs: list[tuple[str, dict[str, Any], float, float | None, bool]], gap: float
) -> None:
    gpus = [gpu(0), gpu(1), gpu(2, mig=True, instances=(instance(2, "3g.40gb", 4),)), gpu(3, mig=True)]
    modes = {"GPU-0001": "mps"}
    modes.update({i.uuid: "timeslice" for i in gpus[2].instances})
    cfg = SchedulerConfig(mig=MigPolicy(min_idle_s=50, min_reconfig_interval_s=100), preempt_after_s=200,
                          preempt_min_gain_s=10)
    n = Node(Scheduler(cfg), gpus, share_modes=modes, dynamic=frozenset({3}))

    def check(nd: Node) -> None:
        # Shares suspended in place hold their memory and slot but no compute (the engine contract).
        c = Cluster.build(nd.gpus, list(nd.active.values()), share_modes=nd.share_modes, yielded=frozenset(nd.yielded))
        assert c.violations() == []
        assert not c.overcommitted
        held = [u for j in nd.active.values() if j.allocation and j.allocation.share is None
                for u in j.allocation.uuids]
        assert len(held) == len(set(held))

    for k, (user, req, dur, limit, requeue) in enumerate(jobs):
        n.run_until(n.now + gap, on_tick=check)
        n.submit(job(k + 1, user, time_limit=limit, requeue=requeue, **req), min(dur, limit or dur))
        n.step()
        check(n)
    n.run_until(10**6, on_tick=check)
    assert not n.pending  # everything that can run did run
    assert all(j.state is JobState.RUNNING for j in n.active.values())


def test_incremental_and_snapshot_modes_decide_the_same() -> None:
    runs = []
    for incremental in (False, True):
        r = random.Random(11)
        n = Node(Scheduler(incremental=incremental), [gpu(i) for i in range(4)])
        for k in range(60):
            n.submit(job(k + 1, r.choice("xyz"), gpus=r.choice([1, 2]), time_limit=r.choice([None, 900.0])),
                     r.uniform(100, 900))
        n.run_until(50_000)
        runs.append([(type(a).__name__, getattr(a, "job_id", None)) for a in n.actions])
    assert runs[0] == runs[1]


@settings(max_examples=40, deadline=None)
@given(
    weights=st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), st.integers(1, 1000), max_size=4),
    warm=st.lists(st.tuples(st.sampled_from(["a", "b", "c", "d"]), st.floats(10, 5000)), max_size=6),
    batch=st.lists(st.tuples(st.sampled_from(["a", "b", "c", "d"]), st.integers(1, 2),
                             st.sampled_from([None, 30.0, 7200.0]), st.sampled_from(["batch", "interactive"]),
                             st.integers(0, 2)), min_size=1, max_size=20),
)
def test_fairness_order_predicts_the_next_starts_exactly(
    weights: dict[str, int], warm: list[tuple[str, float]],
    batch: list[tuple[str, int, float | None, str, int]],
) -> None:
    """`gpusched queue --order fairness` is the truth: with room for everyone, the pass starts the
    pending jobs in exactly that order (commitments, deadlines, eligibility and V all replayed)."""
    n = Node(Scheduler(SchedulerConfig(fairness=FairnessConfig(weights=weights)), incremental=True),
             [gpu(i) for i in range(48)])
    jid = 1
    for user, dur in warm:  # some users already run jobs: their commitments and usage count
        n.submit(job(jid, user), dur)
        jid += 1
    n.step()
    n.run_until(n.now + 5)
    for user, gpus_, limit, cls, nice in batch:
        n.submit(job(jid, user, gpus=gpus_, time_limit=limit, job_class=cls, nice=nice), 100)
        jid += 1
    predicted = n.sched.fairness_order()
    assert _starts(n.step()) == predicted


def test_interactive_headroom_never_blocks_a_small_node() -> None:
    """A 2-GPU node keeps no GPU for interactive work (at most a quarter of the node, rounded down):
    otherwise one notebook would block every 2-GPU batch job for the whole window."""
    n = Node(Scheduler(incremental=True), [gpu(0), gpu(1)])
    n.submit(job(1, "alice", job_class="interactive"), 60)
    assert _starts(n.step()) == [1]
    n.run_until(120)  # the interactive job ended a minute ago, well within the window
    n.submit(job(2, "bob", gpus=2), 100)
    assert _starts(n.step()) == [2]


def test_interactive_headroom_keeps_a_gpu_on_a_bigger_node() -> None:
    n = Node(Scheduler(incremental=True), [gpu(i) for i in range(4)])
    n.submit(job(1, "alice", job_class="interactive"), 60)
    assert _starts(n.step()) == [1]
    n.run_until(120)
    n.submit(job(2, "bob", gpus=4), 100)
    n.submit(job(3, "bob", gpus=3), 100)
    assert _starts(n.step()) == [3]  # one GPU stays free for interactive work
    assert "waiting for 4 whole GPU(s) (4 idle now, 1 of them kept for interactive work)" in n.sched.explain(2)


def test_a_paused_share_keeps_its_memory_and_slot_and_gets_its_compute_back_only_if_free() -> None:
    running = [job(1, share=0.5, mem=30_000).model_copy(update={"state": JobState.RUNNING}),
               job(2, share=0.5, mem=30_000).model_copy(update={"state": JobState.RUNNING})]
    c = Cluster.build([gpu(0)], [], share_modes={"GPU-0000": "mps"})
    for j in running:
        alloc = c.place(j, mps_any_uid=True)
        assert alloc is not None
        c.commit(j, alloc)
    assert c.place(job(3, share=0.5, mem=1024), mps_any_uid=True) is None  # no compute left
    assert c.pause(1) and c.paused(1)
    assert c.place(job(3, share=0.5, mem=30_000), mps_any_uid=True) is None  # its memory is still held
    third = job(3, share=0.5, mem=1024)
    alloc = c.place(third, mps_any_uid=True)
    assert alloc is not None
    c.commit(third, alloc)
    assert not c.unpause(1) and c.paused(1)  # compute taken: it stays paused, nothing changed
    c.release(3)
    assert c.unpause(1) and not c.paused(1)
    assert c.place(job(4, share=0.1, mem=1024), mps_any_uid=True) is None
    assert not c.pause(99) and not c.unpause(99)  # unknown jobs: nothing to do


def test_an_interactive_share_suspends_a_batch_share_in_place_and_it_loses_no_work() -> None:
    n = Node(Scheduler(incremental=True), [gpu(0)], share_modes={"GPU-0000": "mps"})
    n.submit(job(1, "trainer", share=0.5, mem=10_000), 10_000.0)
    n.submit(job(2, "trainer", share=0.5, mem=10_000), 10_000.0)
    n.run_until(100.0)
    assert set(n.active) == {1, 2}
    n.submit(job(3, "alice", share=0.5, mem=10_000, job_class="interactive"), 500.0)
    n.run_until(101.0)
    suspends = [a for a in n.actions if isinstance(a, PreemptJob)]
    assert [a.mode for a in suspends] == ["suspend"] and n.active[3].state is JobState.RUNNING
    victim = suspends[0].job_id
    assert n.active[victim].state is JobState.SUSPENDED and n.active[victim].allocation is not None
    n.run_until(700.0)
    assert [a.job_id for a in n.actions if isinstance(a, ResumeJob)] == [victim]
    n.run_until(20_000.0)
    assert set(n.done) == {1, 2, 3}
    # Each trainer job ran its 10,000 s once: the suspended one ended later by the time it stood still.
    last_start = {jid: n.done[jid].started_at for jid in (1, 2)}
    assert last_start[victim] is not None and last_start[victim] >= 600.0  # its clock restarted at the resume
    assert n.service["trainer"] == pytest.approx(0.5 * 10_000.0 * 2)


def test_idle_dynamic_gpus_leave_mig_mode_for_a_whole_gpu_job_and_come_back_for_mig_work() -> None:
    """Issue 11: dynamic MIG must not drop the 8-GPU pods. Both GPUs are dynamic and in MIG mode;
    a 2-GPU job switches them out of it once they have been idle `min_idle_s`, and a MIG job
    afterwards switches one back."""
    cfg = SchedulerConfig(mig=MigPolicy(min_idle_s=60.0, min_reconfig_interval_s=120.0))
    n = Node(Scheduler(cfg, incremental=True), [gpu(0, mig=True), gpu(1, mig=True)], dynamic=frozenset({0, 1}))
    n.submit(job(1, "alice", gpus=2), 1000.0)
    n.run_until(30.0)
    assert 1 in n.pending and not any(isinstance(a, SetMigMode) for a in n.actions)  # idle < min_idle_s
    n.run_until(200.0)
    switches = [a for a in n.actions if isinstance(a, SetMigMode)]
    assert [(a.gpu_index, a.enabled) for a in switches] == [(0, False), (1, False)]
    assert 1 in n.active
    ended = n.ends[1]
    n.run_until(ended + 5.0)
    assert 1 in n.done
    n.submit(job(2, "bob", mig="1g.10gb"), 300.0)
    n.run_until(ended + 30.0)
    assert 2 in n.pending  # the GPUs have been idle less than min_idle_s
    n.run_until(ended + 200.0)
    switches = [a for a in n.actions if isinstance(a, SetMigMode)]
    assert [(a.gpu_index, a.enabled) for a in switches][2:] == [(0, True)]
    assert 2 in n.active and n.gpus[0].mig_enabled and not n.gpus[1].mig_enabled


def test_mig_mode_is_not_switched_when_it_would_not_make_the_job_fit() -> None:
    cfg = SchedulerConfig(mig=MigPolicy(min_idle_s=0.0, min_reconfig_interval_s=0.0))
    busy_mig = instance(1, "3g.40gb", 0)
    n = Node(Scheduler(cfg, incremental=True), [gpu(0, mig=True), gpu(1, mig=True, instances=(busy_mig,))],
             dynamic=frozenset({0, 1}))
    n.submit(job(1, "alice", mig="3g.40gb"), 10_000.0)
    n.run_until(10.0)
    assert 1 in n.active
    n.submit(job(2, "bob", gpus=2), 100.0)
    n.run_until(500.0)
    assert not any(isinstance(a, SetMigMode) for a in n.actions)  # GPU 1 is busy: GPU 0 alone would not do
    assert 2 in n.pending


def test_the_saved_preemption_count_of_a_job_cancelled_after_its_requeue_is_dropped() -> None:
    """export_preemptions() is saved at every pass with actions: a job preempted (requeued), then
    cancelled while it waited, stayed in it for ever (retention audit)."""
    n = _trainer_then_interactive()
    n.step()
    n.now = 3600 + 601
    [pre] = [a for a in n.step() if isinstance(a, PreemptJob)]
    victim = pre.job_id
    assert victim in n.pending
    n.pending.pop(victim)  # the owner cancels it while it waits: the engine calls remove(), then, as
    n.sched.remove(victim)  # the job has ended for good, forget_ended()
    assert str(victim) in n.sched.export_preemptions()["times"]  # (a hold also calls remove(): kept)
    n.sched.forget_ended(victim)
    for _ in range(3):
        n.now += 60
        n.step()
    assert str(victim) not in n.sched.export_preemptions()["times"], n.sched.export_preemptions()


_queued = st.tuples(
    st.integers(1, 30),  # id: some given twice, as a restart's list never has but submit_many allows
    st.sampled_from(["a", "b", "c"]),
    st.integers(1, 2),
    st.integers(0, 3),  # nice
    st.floats(0, 1000),  # submitted
    st.sampled_from([None, 60.0, 3000.0]),
    st.sampled_from(["batch", "interactive"]),
)


@settings(max_examples=60, deadline=None)
@given(before=st.lists(_queued, max_size=8), batch=st.lists(_queued, min_size=1, max_size=30),
       node_seen=st.booleans())
def test_submitting_many_at_once_is_submitting_each_in_turn(
    before: list[tuple[int, str, int, int, float, float | None, str]],
    batch: list[tuple[int, str, int, int, float, float | None, str]], node_seen: bool,
) -> None:
    """A restart hands its whole queue over with submit_many (each user's jobs sorted once): the same
    order, waits and decisions as submitting them one by one, onto a queue already holding some."""
    # A job id given twice belongs to one user (a job is resubmitted by its owner; another user's job
    # never takes its id): with two owners the one-by-one order depends on which copy came last.
    owner: dict[int, str] = {}
    for jid, user, *_ in (*before, *batch):
        owner.setdefault(jid, user)

    def make(spec: tuple[int, str, int, int, float, float | None, str]) -> Any:
        jid, _, gpus, nice, submitted, limit, job_class = spec
        return job(jid, owner[jid], gpus=gpus, nice=nice, submitted=submitted, time_limit=limit,
                   job_class=job_class)

    gpus = (gpu(0), gpu(1))
    nodes = []
    for at_once in (False, True):
        sched = Scheduler()
        if node_seen:
            sched.plan(Snapshot(gpus=gpus, pending=(), active=()), 0.0)
        for spec in before:
            sched.submit(make(spec))
        jobs = [make(spec) for spec in batch]
        if at_once:
            sched.submit_many(jobs)
        else:
            for each in jobs:
                sched.submit(each)
        nodes.append(sched)
    one_by_one, at_once = nodes
    assert at_once.fairness_order() == one_by_one.fairness_order()
    assert at_once._pending_since == one_by_one._pending_since
    assert at_once._interactive_pending == one_by_one._interactive_pending
    assert {u: list(at_once.queue.jobs_of(u)) for u in "abc"} == {u: list(one_by_one.queue.jobs_of(u)) for u in "abc"}
    assert at_once.queue.largest_whole() == one_by_one.queue.largest_whole()
    assert at_once.queue._order == one_by_one.queue._order  # every user's place (deadline, user)
    snap = Snapshot(gpus=gpus, pending=(), active=())
    assert at_once.plan(snap, 2000.0) == one_by_one.plan(snap, 2000.0)
