"""Accounting figures from job histories: service in a window, waits, Jain's index."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpusched.core.accounting import (
    active_intervals,
    device_busy_fraction,
    fairness_index,
    jain_index,
    user_stats,
    waits,
)
from gpusched.model import AllocatedDevice, Allocation, Job, JobSpec, JobState, Transition, WholeRequest

S = JobState


def job(job_id: int, user: str, steps: list[tuple[JobState, float]], fraction: float = 1.0) -> Job:
    spec = JobSpec(argv=["x"], cwd="/", request=WholeRequest(gpus=1))
    alloc = Allocation(devices=[AllocatedDevice(uuid=f"GPU-{job_id % 2}", gpu_index=job_id % 2, kind="gpu")],
                       compute_fraction=fraction)
    history = [Transition(state=s, at=t, reason="") for s, t in steps]
    final = steps[-1]
    return Job(id=job_id, uid=1000, gid=1000, user=user, spec=spec, state=final[0], submitted_at=steps[0][1],
               ended_at=final[1] if final[0] in (S.COMPLETED, S.FAILED, S.CANCELLED) else None,
               allocation=alloc, history=history)


def test_active_intervals_include_suspension_and_requeue() -> None:
    j = job(1, "a", [(S.PENDING, 0), (S.STARTING, 10), (S.RUNNING, 11), (S.SUSPENDED, 20), (S.RUNNING, 25),
                     (S.PREEMPTED, 30), (S.PENDING, 30), (S.STARTING, 40), (S.RUNNING, 41)])
    assert active_intervals(j, now=50) == [(10, 30), (40, 50)]
    assert [(w.runnable_at, w.started_at) for w in waits(j)] == [(0, 10), (30, 40)]


def test_time_suspended_is_held_but_not_service() -> None:
    """`stats` counted a suspended job's time as service, which the scheduler does not charge, so its
    shares and Jain's index measured something else than what the scheduler balances (audit)."""
    j = job(1, "a", [(S.PENDING, 0), (S.STARTING, 0), (S.RUNNING, 0), (S.SUSPENDED, 2), (S.RUNNING, 6),
                     (S.COMPLETED, 7)])
    [stats] = user_stats([j], since=0, now=10, weight_of=lambda _: 100.0)
    assert stats.runtime_s == 7 and stats.service_gpu_s == pytest.approx(3.0)
    assert device_busy_fraction([j], since=0, now=10) == {"GPU-1": pytest.approx(0.7)}  # the device was held


def test_held_time_is_not_a_scheduling_delay() -> None:
    j = job(1, "a", [(S.PENDING, 0), (S.HELD, 1), (S.PENDING, 100), (S.STARTING, 105), (S.RUNNING, 105),
                     (S.COMPLETED, 110)])
    assert [w.seconds for w in waits(j)] == [5]


def test_user_stats_in_a_window() -> None:
    jobs = [
        job(1, "alice", [(S.PENDING, 0), (S.STARTING, 0), (S.RUNNING, 0), (S.COMPLETED, 100)]),
        job(2, "bob", [(S.PENDING, 0), (S.STARTING, 50), (S.RUNNING, 50), (S.COMPLETED, 100)], fraction=0.5),
        job(3, "carol", [(S.PENDING, 0), (S.STARTING, 1), (S.RUNNING, 1), (S.COMPLETED, 10)]),  # before window
    ]
    weights = {"alice": 200.0, "bob": 100.0}
    stats = {s.user: s for s in user_stats(jobs, since=20, now=100, weight_of=lambda u: weights.get(u, 100.0))}
    assert set(stats) == {"alice", "bob"}
    assert stats["alice"].service_gpu_s == pytest.approx(80)
    assert stats["bob"].service_gpu_s == pytest.approx(25)
    assert stats["alice"].entitled == pytest.approx(2 / 3)
    assert stats["alice"].share == pytest.approx(80 / 105)
    assert stats["bob"].starts == 1 and stats["bob"].wait_max_s == 50 and stats["bob"].wait_max_at == 50
    assert stats["alice"].starts == 0  # its start fell before the window
    assert device_busy_fraction(jobs, 20, 100) == {"GPU-1": pytest.approx(1.0), "GPU-0": pytest.approx(50 / 80)}


def test_fairness_index_is_one_when_service_matches_entitlement() -> None:
    jobs = [
        job(1, "alice", [(S.PENDING, 0), (S.STARTING, 0), (S.RUNNING, 0), (S.COMPLETED, 100)]),
        job(2, "bob", [(S.PENDING, 0), (S.STARTING, 0), (S.RUNNING, 0), (S.COMPLETED, 100)], fraction=0.5),
    ]
    stats = user_stats(jobs, 0, 100, lambda u: 200.0 if u == "alice" else 100.0)
    assert fairness_index(stats) == pytest.approx(1.0)


@given(st.lists(st.floats(min_value=0, max_value=1e6), min_size=1, max_size=50))
def test_jain_index_is_between_one_over_n_and_one(values: list[float]) -> None:
    index = jain_index(values)
    assert 1 / len(values) - 1e-9 <= index <= 1 + 1e-9


def test_jain_index_holds_for_values_whose_squares_underflow_or_overflow() -> None:
    """Found by the property above: two equal values of 1e-159 gave 1.0000009 (their squares are
    subnormal); the index is scale-free, so tiny and huge values are scaled first."""
    assert jain_index([1.1452586174591122e-159, 1.1452586174591122e-159]) == 1.0
    assert jain_index([1e-300, 0.0]) == 0.5
    assert jain_index([1e200, 1e200, 1e200]) == 1.0
