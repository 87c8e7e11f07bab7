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


def _named(jid: int, name: str, user: str = "alice") -> object:
    j = job(jid, user, gpus=1)
    return j.model_copy(update={"spec": j.spec.model_copy(update={"name": name})})


def test_a_command_that_gains_history_is_estimated_from_it_even_after_a_shape_estimate() -> None:
    """Jobs of commands never seen share their shape's estimate; once the command has run, its own
    history answers, for jobs asked about before as well."""
    est = RuntimeEstimator(EstimatorConfig(default_runtime_s=3600.0))
    waiting, other = _named(1, "train"), _named(2, "eval")
    est.observe(other, 100.0)  # a shape estimate exists now: 100 s for gpus=1
    assert est.estimate(waiting).seconds == 100.0 and "shape" in est.estimate(waiting).source
    est.observe(_named(3, "train"), 40.0)
    assert est.estimate(waiting).seconds == 40.0 and "this command" in est.estimate(waiting).source


def test_a_command_whose_history_was_evicted_falls_back_to_its_shape() -> None:
    est = RuntimeEstimator(EstimatorConfig(default_runtime_s=3600.0, max_keys=5))
    waiting = _named(1, "train")
    est.observe(_named(2, "train"), 40.0)  # 5 keys: two for the command, two for the shape, global
    assert est.estimate(waiting).seconds == 40.0
    for k in range(3):  # each new command adds two keys and pushes the oldest out
        est.observe(_named(10 + k, f"other-{k}", user=f"u{k}"), 500.0)
    assert "this command" not in est.estimate(waiting).source


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 2), st.integers(0, 2), st.integers(1, 2),
                          st.floats(1, 1e5), st.sampled_from([None, 50.0, 1e6])), max_size=40),
       st.integers(3, 12))
def test_memoised_estimates_equal_a_fresh_estimators(
        steps: list[tuple[bool, int, int, int, float, float | None]], max_keys: int) -> None:
    """Whatever was learned (and evicted) in between, an estimate equals the one a new estimator
    with the same history gives: memo answers must never be stale."""
    est = RuntimeEstimator(EstimatorConfig(max_keys=max_keys, history=3))
    learned: list[tuple[object, float]] = []
    for k, (observe, user, cmd, gpus, runtime, limit) in enumerate(steps):
        j = job(k, f"u{user}", gpus=gpus, time_limit=limit).model_copy(deep=True)
        j.spec.argv[0] = f"cmd{cmd}"
        if observe:
            est.observe(j, runtime)
            learned.append((j, runtime))
            continue
        fresh = RuntimeEstimator(EstimatorConfig(max_keys=max_keys, history=3))
        for seen, r in learned:
            fresh.observe(seen, r)  # type: ignore[arg-type]
        assert est.estimate(j) == fresh.estimate(j)
        assert est.estimate(j) == fresh.estimate(j)  # asked twice: the memo's answer


def test_a_key_evicted_and_learned_again_does_not_revive_an_old_estimate() -> None:
    est = RuntimeEstimator(EstimatorConfig(max_keys=6))
    a = job(1, "alice")
    est.observe(a, 10.0)
    assert est.predict(a) == 10.0  # memoised from alice's own runs of the command
    for k in range(5):  # others' jobs of other commands push all of alice's keys out
        other = job(100 + k, f"user{k}", gpus=2).model_copy(deep=True)
        other.spec.argv[0] = f"other{k}"
        est.observe(other, 1.0)
    est.observe(a, 20.0)  # learned again from scratch: one run, as before, but another one
    assert est.predict(a) == 20.0
