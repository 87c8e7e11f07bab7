"""MIG planning: valid layouts only, busy instances untouched, hysteresis, declarative apply."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpusched.core.migplan import (
    MigPolicy,
    Slot,
    layout_violations,
    plan_dynamic,
    plan_layout_change,
    slot_of,
)
from gpusched.gpu.profiles import place_layout, profiles_for

from .helpers import gpu, instance

M = "H100-80GB"


def test_creates_in_free_space_keeping_large_holes() -> None:
    g = gpu(0, mig=True)
    plan = plan_dynamic([g], set(), ["1g.10gb"])
    assert len(plan.creates) == 1 and not plan.destroys
    # a 1g at start 0 would kill the 4g (start 0) and both 3g slots' first half; the planner avoids it
    assert plan.creates[0].start == 6


def test_prefers_the_already_split_gpu() -> None:
    split = gpu(0, mig=True, instances=(instance(0, "3g.40gb", 0),))
    empty = gpu(1, mig=True)
    plan = plan_dynamic([split, empty], set(), ["1g.10gb"])
    assert plan.creates[0].gpu_index == 0


def test_destroys_only_idle_long_enough_and_never_busy() -> None:
    busy_i = instance(0, "3g.40gb", 0)
    idle_i = instance(0, "3g.40gb", 4)
    g = gpu(0, mig=True, instances=(busy_i, idle_i))
    pol = MigPolicy(min_idle_s=300, min_reconfig_interval_s=600)
    # idle only 100 s: nothing may go, so the 4g.40gb demand stays unmet
    p = plan_dynamic([g], {busy_i.uuid}, ["2g.20gb"], idle_since={idle_i.uuid: 0.0}, now=100, policy=pol)
    assert not p.creates and p.unmet == ("2g.20gb",)
    p = plan_dynamic([g], {busy_i.uuid}, ["2g.20gb"], idle_since={idle_i.uuid: 0.0}, now=400, policy=pol)
    assert [d.uuid for d in p.destroys] == [idle_i.uuid]
    assert p.creates[0].start in (4, 6) and busy_i.uuid not in {d.uuid for d in p.destroys}
    # hysteresis: the GPU was reconfigured 100 s ago
    p = plan_dynamic([g], {busy_i.uuid}, ["2g.20gb"], idle_since={idle_i.uuid: 0.0}, now=400, policy=pol,
                     last_reconfig={0: 300.0})
    assert not p.destroys and not p.creates


def test_idle_instance_wanted_by_pending_jobs_is_kept() -> None:
    idle_i = instance(0, "7g.80gb", 0)
    g = gpu(0, mig=True, instances=(idle_i,))
    p = plan_dynamic([g], set(), ["1g.10gb"], pending_profiles={"7g.80gb"},
                     idle_since={idle_i.uuid: 0.0}, now=1e6)
    assert not p.destroys


def test_layout_change_is_incremental() -> None:
    keep = instance(0, "3g.40gb", 4)
    other = instance(0, "2g.20gb", 0)
    ch = plan_layout_change(M, [keep, other], {keep.uuid: 7}, ["3g.40gb", "1g.10gb", "1g.10gb"])
    assert ch.ok, ch.error
    assert keep.uuid in ch.keep and ch.destroy == (other.uuid,)
    slots = [slot_of(keep, M)] + [Slot(p, s, 1, 1) for p, s in ch.create]
    assert layout_violations(M, slots) == []


def test_layout_change_refuses_to_remove_a_busy_instance() -> None:
    busy = instance(0, "4g.40gb", 0)
    ch = plan_layout_change(M, [busy], {busy.uuid: 42}, ["7g.80gb"])
    assert not ch.ok and "job 42" in (ch.error or "") and busy.uuid in (ch.error or "")


def test_layout_change_rejects_invalid_targets() -> None:
    assert "no MIG profile" in (plan_layout_change(M, [], set(), ["9g.1gb"]).error or "")
    assert not plan_layout_change(M, [], set(), ["4g.40gb", "4g.40gb"]).ok


_profiles = [p.name for p in profiles_for(M) if "+me" not in p.name]


@st.composite
def _layouts(draw: st.DrawFn) -> list[tuple[str, int]]:
    names = draw(st.lists(st.sampled_from(_profiles), max_size=5))
    try:
        return place_layout(M, names)
    except ValueError:
        return []


@settings(max_examples=80, deadline=None)
@given(layout=_layouts(), busy_mask=st.integers(0, 127), demand=st.lists(st.sampled_from(_profiles), max_size=6),
       now=st.floats(0, 2000))
def test_dynamic_plans_are_valid_and_spare_busy_instances(
    layout: list[tuple[str, int]], busy_mask: int, demand: list[str], now: float
) -> None:
    insts = tuple(instance(0, p, s) for p, s in layout)
    if layout_violations(M, [slot_of(i, M) for i in insts]):
        return  # place_layout does not check the compute-slice total
    busy = {i.uuid for k, i in enumerate(insts) if busy_mask >> k & 1}
    g = gpu(0, mig=True, instances=insts)
    plan = plan_dynamic([g], busy, demand, idle_since={i.uuid: 0.0 for i in insts}, now=now)
    destroyed = {d.uuid for d in plan.destroys}
    assert not destroyed & busy
    final = [slot_of(i, M) for i in insts if i.uuid not in destroyed]
    for c in plan.creates:
        p = next(x for x in profiles_for(M) if x.name == c.profile)
        final.append(Slot(c.profile, c.start, p.memory_slices, p.slices))
    assert layout_violations(M, final) == []


@settings(max_examples=60, deadline=None)
@given(layout=_layouts(), busy_mask=st.integers(0, 127), target=st.lists(st.sampled_from(_profiles), max_size=5))
def test_layout_change_results_are_valid(layout: list[tuple[str, int]], busy_mask: int, target: list[str]) -> None:
    insts = [instance(0, p, s) for p, s in layout]
    busy = {i.uuid for k, i in enumerate(insts) if busy_mask >> k & 1}
    ch = plan_layout_change(M, insts, busy, target)
    if not ch.ok:
        return
    assert not set(ch.destroy) & busy
    kept = [slot_of(i, M) for i in insts if i.uuid in ch.keep]
    final = kept + [Slot(p, s, next(x for x in profiles_for(M) if x.name == p).memory_slices,
                         next(x for x in profiles_for(M) if x.name == p).slices) for p, s in ch.create]
    assert layout_violations(M, final) == []
    assert sorted(s.profile for s in final) == sorted(target)
