"""Placement: whole/NUMA, MIG best fit, MPS/timeslice shares, precision affinity, satisfiability."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gpusched.core.placement import Cluster, unsatisfiable_reason
from gpusched.model import ShareRequest, WholeRequest

from .helpers import gpu, instance, job


def test_whole_gpus_prefer_one_numa_node_best_fit() -> None:
    gpus = [gpu(i, numa=0 if i < 4 else 1) for i in range(8)]
    c = Cluster.build(gpus, [])
    first = c.place(job(99, gpus=1))
    assert first is not None
    c.commit(job(99), first)  # node 0 now has 3 free
    alloc = c.place(job(1, gpus=2))
    assert alloc is not None
    assert {d.gpu_index for d in alloc.devices} <= {0, 1, 2, 3}  # fewest-free node that fits
    alloc4 = c.place(job(2, gpus=4))
    assert alloc4 is not None and {d.gpu_index for d in alloc4.devices} == {4, 5, 6, 7}


def test_whole_spans_nodes_when_no_node_has_enough() -> None:
    gpus = [gpu(i, numa=i // 2) for i in range(4)]
    alloc = Cluster.build(gpus, []).place(job(1, gpus=3))
    assert alloc is not None and len(alloc.devices) == 3 and alloc.compute_fraction == 3.0


def test_mig_best_fit_prefers_the_fuller_gpu() -> None:
    a = (instance(0, "3g.40gb", 0), instance(0, "3g.40gb", 4))
    b = (instance(1, "3g.40gb", 0), instance(1, "3g.40gb", 4))
    gpus = [gpu(0, mig=True, instances=a), gpu(1, mig=True, instances=b)]
    holder = job(9, mig="3g.40gb")
    c = Cluster.build(gpus, [])
    first = c.place(holder)
    assert first is not None
    c.commit(holder, first)
    second = c.place(job(1, mig="3g.40gb"))
    assert second is not None and second.devices[0].gpu_index == first.devices[0].gpu_index
    assert second.compute_fraction == 60 / 132


def test_precision_affinity_keeps_classes_apart() -> None:
    gpus = [gpu(0), gpu(1)]
    modes = {"GPU-0000": "timeslice", "GPU-0001": "timeslice"}
    c = Cluster.build(gpus, [], share_modes=modes)
    half = job(1, share=0.25, precision="bf16")
    a1 = c.place(half)
    assert a1 is not None
    c.commit(half, a1)
    full = job(2, share=0.25, precision="fp32")
    a2 = c.place(full)
    assert a2 is not None and a2.devices[0].uuid != a1.devices[0].uuid
    assert a2.env == {"NVIDIA_TF32_OVERRIDE": "0"}
    half2 = job(3, share=0.25, precision="fp16")
    a3 = c.place(half2)
    assert a3 is not None and a3.devices[0].uuid == a1.devices[0].uuid  # packs with its own class


def test_mps_device_serves_one_uid_at_a_time() -> None:
    c = Cluster.build([gpu(0)], [], share_modes={"GPU-0000": "mps"})
    a = job(1, "alice", share=0.5)
    alloc = c.place(a)
    assert alloc is not None and alloc.share == 0.5 and alloc.compute_fraction == 0.5
    c.commit(a, alloc)
    assert c.place(job(2, "bob", share=0.1)) is None
    assert c.place(job(3, "alice", share=0.5)) is not None
    assert c.place(job(4, "alice", share=0.6)) is None  # fraction would exceed 1
    c.release(1)
    assert c.place(job(2, "bob", share=0.1)) is not None  # idle server: any uid


def test_share_memory_is_accounted() -> None:
    c = Cluster.build([gpu(0)], [], share_modes={"GPU-0000": "timeslice"})
    big = job(1, share=0.1, mem=80_000)
    alloc = c.place(big)
    assert alloc is not None
    c.commit(big, alloc)
    assert c.place(job(2, "bob", share=0.1, mem=2000)) is None
    assert c.place(job(3, "bob", share=0.1, mem=1000)) is not None


def test_exclusive_device_gets_no_shares_and_whole_avoids_share_devices() -> None:
    gpus = [gpu(0), gpu(1)]
    c = Cluster.build(gpus, [], share_modes={"GPU-0000": "mps"})
    alloc = c.place(job(1, gpus=1))
    assert alloc is not None and alloc.devices[0].uuid == "GPU-0001"
    s = c.place(job(2, share=0.2))
    assert s is not None and s.devices[0].uuid == "GPU-0000"


def test_unsatisfiable_reasons_know_share_modes_and_dynamic_mig() -> None:
    gpus = [gpu(0), gpu(1, mig=True, instances=(instance(1, "3g.40gb", 0),))]
    share = ShareRequest(fraction=0.5, gpu_mem_mib=1000)
    assert "configured for sharing" in (unsatisfiable_reason(share, gpus) or "")
    assert unsatisfiable_reason(share, gpus, {"GPU-0000": "mps"}) is None
    huge = ShareRequest(fraction=0.5, gpu_mem_mib=500_000)
    assert "largest shared device" in (unsatisfiable_reason(huge, gpus, {"GPU-0000": "mps"}) or "")
    from gpusched.model import MigRequest
    assert "3g.40gb" in (unsatisfiable_reason(MigRequest(profile="1g.10gb"), gpus) or "")
    assert unsatisfiable_reason(MigRequest(profile="1g.10gb"), gpus, dynamic=frozenset({1})) is None
    assert "1 GPU(s) with MIG off" in (unsatisfiable_reason(WholeRequest(gpus=2), gpus) or "")


_req = st.one_of(
    st.builds(lambda n: {"gpus": n}, st.integers(1, 3)),
    st.builds(lambda p: {"mig": p}, st.sampled_from(["1g.10gb", "2g.20gb", "3g.40gb"])),
    st.builds(lambda f, m: {"share": f, "mem": m}, st.floats(0.05, 1.0), st.integers(1, 60_000)),
)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), _req, st.sampled_from(["a", "b", "c"]),
                              st.sampled_from([None, "fp16", "fp32"])), min_size=1, max_size=40))
def test_no_device_memory_or_mps_slot_is_ever_over_allocated(
    ops: list[tuple[bool, dict[str, Any], str, str | None]],
) -> None:
    gpus = [gpu(0, numa=0), gpu(1, numa=0), gpu(2, numa=1),
            gpu(3, mig=True, instances=(instance(3, "3g.40gb", 4), instance(3, "2g.20gb", 0),
                                        instance(3, "1g.10gb", 2), instance(3, "1g.10gb", 3)))]
    modes = {"GPU-0001": "mps", "GPU-0002": "timeslice"}
    modes.update({i.uuid: "mps" for i in gpus[3].instances if i.profile == "3g.40gb"})
    c = Cluster.build(gpus, [], share_modes=modes)
    live: list[int] = []
    for k, (release, req, user, prec) in enumerate(ops):
        if release and live:
            c.release(live.pop(0))
            continue
        j = job(k + 1, user, precision=prec, **req)
        alloc = c.place(j)
        if alloc is not None:
            c.commit(j, alloc)
            live.append(j.id)
        assert c.violations() == []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5)), max_size=14), st.integers(2, 6),
       st.sets(st.integers(0, 7), max_size=3), st.randoms(use_true_random=False))
def test_whole_after_releases_answers_what_releasing_one_by_one_would(
        starts: list[tuple[int, int]], n: int, forbidden_idx: set[int], rnd: Any) -> None:
    """The reservation of an n-GPU job reads its answer off who holds each GPU; releasing job after
    job on a copy and asking place() each time must give the same step and the same GPUs."""
    gpus = [gpu(i, numa=i // 4) for i in range(8)]
    modes = {f"GPU-{i:04d}": "mps" for i in (1, 2, 6)}
    c = Cluster.build(gpus, [], share_modes=modes)
    for k, (kind, size) in enumerate(starts):
        j = job(10 + k, gpus=1 + size % 2) if kind < 2 else job(10 + k, share=0.2 + size / 10, uid=1 + kind)
        alloc = c.place(j, mps_any_uid=True)
        if alloc is not None:
            c.commit(j, alloc)
    order = list(c.held)
    rnd.shuffle(order)
    order = order[: max(0, len(order) - rnd.randrange(2))]  # a job that never ends, sometimes
    forbidden = frozenset(f"GPU-{i:04d}" for i in forbidden_idx)
    head = job(1, gpus=n)
    expected: tuple[int, frozenset[str]] | None = None
    sim = c.copy()
    for step, jid in enumerate(order):
        sim.release(jid)
        alloc = sim.place(head, forbidden=forbidden)
        if alloc is not None:
            expected = (step, frozenset(alloc.uuids))
            break
    found = c.whole_after_releases(n, forbidden, order)
    got = (found[0], frozenset(d.uuid for d in found[1])) if found is not None else None
    if c.place(head, forbidden=forbidden) is None:  # (the reservation is asked only then)
        assert got == expected


def test_freed_since_names_the_devices_whose_usage_dropped() -> None:
    """What the scheduler's kept failures rely on (sched_scan._still_failing): after a mark, the
    log names every device a release freed; additions are not frees; an unknown change forgets."""
    c = Cluster.build([gpu(0), gpu(1), gpu(2)], [])
    for jid in (1, 2):
        alloc = c.place(job(jid, gpus=1))
        assert alloc is not None
        c.commit(job(jid, gpus=1), alloc)
    first = c.free_mark()
    assert c.freed_since(first) == frozenset()
    c.release(1)
    after_one = c.free_mark()
    alloc3 = c.place(job(3, gpus=1))
    assert alloc3 is not None
    c.commit(job(3, gpus=1), alloc3)  # an addition: nothing more is freed
    assert c.freed_since(after_one) == frozenset()
    assert c.freed_since(first) == {"GPU-0000"}
    c.release(2)
    assert c.freed_since(first) == {"GPU-0000", "GPU-0001"}
    assert c.freed_since(after_one) == {"GPU-0001"}
    c.invalidate(None)  # changed anywhere: what was failing may fit anywhere
    assert c.freed_since(first) is None and c.freed_since(after_one) is None
    assert c.freed_since(c.free_mark()) == frozenset()
