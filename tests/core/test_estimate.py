"""Run-time estimates: history by key, capped by --time, never below k x elapsed, bounded memory."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpusched.core.estimate import EstimatorConfig, RuntimeEstimator

from .helpers import job


def test_most_specific_history_wins_then_broader_keys_then_the_default() -> None:
    est = RuntimeEstimator(EstimatorConfig(default_runtime_s=999.0))
    a = job(1, "alice")
    assert est.estimate(a).seconds == 999.0 and "default" in est.estimate(a).source
    est.observe(job(2, "bob"), 10.0)  # same command (argv), another user
    assert est.estimate(a).seconds == 10.0 and est.estimate(a).source == "previous runs of this command"
    est.observe(job(3, "alice"), 30.0)
    assert est.estimate(a).seconds == 30.0 and est.estimate(a).source == "your previous runs of this command"
    limited = job(4, "alice", time_limit=5.0)
    assert est.estimate(limited).seconds == 5.0 and est.estimate(limited).source == "its time limit"


def test_mean_of_the_last_runs_only() -> None:
    est = RuntimeEstimator(EstimatorConfig(history=2))
    for runtime in (1000.0, 10.0, 20.0):
        est.observe(job(1, "alice"), runtime)
    assert est.predict(job(9, "alice")) == 15.0


def test_history_round_trips_and_ignores_garbage() -> None:
    est = RuntimeEstimator()
    est.observe(job(1, "alice"), 42.0)
    again = RuntimeEstimator()
    again.load_history({**est.export_history(), "bad": "x", "worse": [True, -1, "y"]})  # type: ignore[dict-item]
    assert again.predict(job(2, "alice")) == 42.0


def test_keys_are_bounded() -> None:
    est = RuntimeEstimator(EstimatorConfig(max_keys=10))
    for k in range(100):
        est.observe(job(k, f"user{k}"), 1.0)
    assert len(est.export_history()) == 10


@settings(max_examples=200, deadline=None)
@given(history=st.lists(st.floats(0, 1e6), max_size=10), elapsed=st.floats(0, 1e7),
       limit=st.one_of(st.none(), st.floats(1, 1e7)), k=st.floats(1, 10))
def test_an_estimate_is_never_below_k_times_elapsed_nor_above_the_limit(
    history: list[float], elapsed: float, limit: float | None, k: float
) -> None:
    est = RuntimeEstimator(EstimatorConfig(elapsed_factor=k))
    for runtime in history:
        est.observe(job(1, "alice"), runtime)
    j = job(2, "alice", time_limit=limit)
    total = est.expected_total(j, est.predict(j), elapsed)
    floor = k * elapsed if limit is None else min(limit, k * elapsed)
    assert total >= floor - 1e-6
    if limit is not None:
        assert total <= limit + 1e-6
