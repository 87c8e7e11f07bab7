"""FairShare: weights, virtual runtime, V, eligibility, deadlines, lag across idle, persistence."""

from __future__ import annotations

import pytest

from gpusched.core.fairshare import FairnessConfig, FairShare


def test_weights_by_name_then_uid_then_default() -> None:
    fs = FairShare(FairnessConfig(weights={"alice": 200, "12345": 50}))
    assert fs.base_weight("alice", 1) == 200
    assert fs.base_weight("bob", 12345) == 50
    assert fs.base_weight("carol", 7) == 100


@pytest.mark.parametrize("w", [0, 10001])
def test_weight_out_of_range_is_refused(w: int) -> None:
    with pytest.raises(ValueError, match=r"1\.\.10000"):
        FairnessConfig(weights={"alice": w})


def test_charge_scales_by_weight_and_V_is_weighted_average() -> None:
    fs = FairShare(FairnessConfig(weights={"alice": 200}))
    fs.activate("alice")
    fs.activate("bob")
    fs.charge("alice", 100.0)  # v += 100*100/200 = 50
    fs.charge("bob", 100.0)  # v += 100
    assert fs.v("alice") == pytest.approx(50.0)
    assert fs.v("bob") == pytest.approx(100.0)
    assert fs.V() == pytest.approx((200 * 50 + 100 * 100) / 300)
    assert fs.is_eligible("alice") and not fs.is_eligible("bob")
    # lag in GPU-seconds: w (V - v) / 100; weighted lags sum to zero
    assert fs.lag("alice") + fs.lag("bob") == pytest.approx(0.0)


def test_interactive_gets_earlier_deadline_at_same_share() -> None:
    fs = FairShare()
    fs.activate("a")
    long_job = 7200.0
    inter = fs.deadline("a", 1.0, fs.request_length(long_job, "interactive"))
    batch = fs.deadline("a", 1.0, fs.request_length(long_job, "batch"))
    assert inter < batch
    # A short batch job's request is its expected length, not the whole quantum.
    assert fs.request_length(60.0, "batch") == 60.0


def test_a_start_commits_its_expected_service_and_the_end_settles_it() -> None:
    fs = FairShare(FairnessConfig(commit_max_s=3600.0))
    fs.activate("a")
    fs.activate("b")
    assert fs.commitment(2.0, 10_000.0) == pytest.approx(7200.0)  # capped at commit_max_s
    fs.charge("a", 0.0, virtual_gpu_s=fs.commitment(1.0, 600.0))  # a starts a 10-minute job
    assert not fs.is_eligible("a") and fs.is_eligible("b")
    assert fs.service("a") == 0.0  # a commitment is not service
    fs.charge("a", 60.0, virtual_gpu_s=0.0)  # it used 60 s, within what it committed
    fs.charge("a", 0.0, virtual_gpu_s=60.0 - 600.0)  # it ended early: the rest is refunded
    assert fs.v("a") == pytest.approx(60.0)
    assert fs.service("a") == pytest.approx(60.0)


def test_refund_while_idle_moves_saved_lag() -> None:
    fs = FairShare(FairnessConfig(lag_limit_gpu_s=1e9))
    fs.activate("a")
    fs.activate("b")
    fs.charge("a", 0.0, virtual_gpu_s=1000.0)
    fs.deactivate("a")
    before = fs.lag("a")
    fs.charge("a", 0.0, virtual_gpu_s=-1000.0)
    assert fs.lag("a") == pytest.approx(before + 1000.0)


def test_new_user_joins_at_lag_zero() -> None:
    fs = FairShare()
    fs.activate("a")
    fs.charge("a", 5000.0)
    fs.activate("b")
    assert fs.lag("b") == pytest.approx(0.0, abs=1e-6)
    assert fs.v("b") == pytest.approx(fs.V())


def test_sleeping_does_not_buy_credit_and_bursting_keeps_debt() -> None:
    fs = FairShare(FairnessConfig(lag_limit_gpu_s=1e9))
    for u in ("a", "b", "c"):
        fs.activate(u)
    fs.charge("a", 3000.0)  # a is above share
    debt = fs.lag("a")
    assert debt < 0
    fs.deactivate("a")
    fs.deactivate("b")  # b leaves owed; c keeps running for a long time
    owed = fs.lag("b")
    fs.charge("c", 1e6)
    fs.activate("a")
    fs.activate("b")
    assert fs.lag("a") == pytest.approx(debt, rel=1e-6)
    assert fs.lag("b") == pytest.approx(owed, rel=1e-6)  # not grown while asleep


def test_lag_is_clamped_while_idle() -> None:
    fs = FairShare(FairnessConfig(lag_limit_gpu_s=100.0))
    fs.activate("a")
    fs.activate("b")
    fs.charge("a", 10_000.0)
    fs.deactivate("a")
    assert fs.lag("a") == pytest.approx(-100.0)


def test_exported_standing_settles_outstanding_commitments() -> None:
    fs = FairShare(FairnessConfig(lag_limit_gpu_s=1e9))
    fs.activate("a")
    fs.activate("b")
    fs.charge("a", 100.0)
    reference = fs.export_standing()
    fs.charge("a", 0.0, virtual_gpu_s=500.0)  # a running job's commitment, unused so far
    fs.set_outstanding("a", 500.0)
    settled = fs.export_standing()
    assert settled["a"]["lag"] == pytest.approx(reference["a"]["lag"])
    assert settled["b"]["lag"] == pytest.approx(reference["b"]["lag"])


def test_standing_round_trip() -> None:
    fs = FairShare()
    fs.activate("a", 1)
    fs.activate("b", 2)
    fs.charge("a", 600.0)
    saved = fs.export_standing()
    assert set(saved) == {"a", "b"}
    assert saved["a"]["service"] == 600.0
    fresh = FairShare()
    fresh.load_standing(saved)
    fresh.activate("a")
    fresh.activate("b")
    assert fresh.lag("a") == pytest.approx(saved["a"]["lag"], rel=1e-6)
    assert fresh.lag("b") == pytest.approx(saved["b"]["lag"], rel=1e-6)
    assert fresh.service("a") == 600.0


def test_group_members_share_the_group_weight() -> None:
    fs = FairShare(FairnessConfig(groups={"a1": "lab", "a2": "lab"}, group_weights={"lab": 100}))
    for u in ("a1", "a2", "solo"):
        fs.activate(u)
    assert fs.weight("a1") == pytest.approx(50.0)
    assert fs.weight("a2") == pytest.approx(50.0)
    assert fs.weight("solo") == pytest.approx(100.0)
    fs.deactivate("a2")
    assert fs.weight("a1") == pytest.approx(100.0)
