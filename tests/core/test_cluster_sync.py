"""cluster_sync: the Cluster kept from pass to pass equals a fresh build after any sequence of changes.

A stale cache here would not crash anything: it would place jobs on a device that is busy, or keep
one idle, so the property compares every device field (floats exactly, client order included),
what each job holds, the over-full set, and the placement answers, against `Cluster.build`.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpusched.core.cluster_sync import sync
from gpusched.core.placement import Cluster
from gpusched.model import AllocatedDevice, Allocation, Job, JobState

from .helpers import gpu, instance, job

_MIG = (instance(2, "3g.40gb", 0, uuid="MIG-a"), instance(2, "2g.20gb", 4, uuid="MIG-b"),
        instance(2, "1g.10gb", 6, uuid="MIG-c"))
GPUS = (gpu(0, numa=0), gpu(1, numa=0), gpu(2, mig=True, instances=_MIG, numa=1), gpu(3, numa=1))
MODES = {"GPU-0000": "mps", "GPU-0001": "timeslice", "MIG-a": "mps", "MIG-b": "timeslice"}
PROBES = [job(900, gpus=1), job(901, gpus=2), job(902, mig="1g.10gb"), job(903, mig="3g.40gb"),
          job(904, share=0.3, mem=20000, uid=1), job(905, share=0.5, mem=1024, uid=2, precision="fp32")]

# One step of what happens between two passes: (kind, a, b, c) read by _apply.
steps = st.lists(st.tuples(st.sampled_from(["start", "start", "start", "end", "yield", "resume",
                                            "pause_live", "fail_start", "move_last", "move_last", "realloc",
                                            "adopt_overfull"]),
                           st.integers(0, 50), st.integers(0, 5), st.booleans()),
                 min_size=1, max_size=30)


def _request(jid: int, a: int, b: int) -> Job:
    uid = 1 + a % 2
    precision = (None, "bf16", None, "fp32")[a % 4]
    kind = a % 5
    if kind == 0:
        return job(jid, gpus=1 + b % 2, uid=uid, precision=precision)
    if kind == 1:
        return job(jid, mig=("1g.10gb", "2g.20gb", "3g.40gb")[b % 3], uid=uid, precision=precision)
    return job(jid, share=(0.1, 0.2, 0.3, 0.15, 0.7, 0.45)[b], mem=1024 * (1 + b), uid=uid, precision=precision)


def _running(j: Job, alloc: Allocation) -> Job:
    return j.model_copy(update={"state": JobState.RUNNING, "allocation": alloc})


def state(c: Cluster, ask: bool = True) -> tuple[object, ...]:
    """Everything a pass can observe; `ask` False leaves the placement memo alone (so several
    changes pile up before the next question, as between passes)."""
    devices = [(d.uuid, d.holder, d.holder_prec, d.used_fraction.hex(), d.used_mem,
                [(k, x.fraction.hex(), x.mem, x.uid, x.prec, x.share.hex()) for k, x in d.clients.items()])
               for d in c.devices.values()]
    answers = [c.place(p, mps_any_uid=True) for p in PROBES] if ask else []
    # the uids a device keeps for the MPS rule are its clients' (or not kept at all)
    assert all(d.uids is None or d.uids == frozenset(x.uid for x in d.clients.values()) for d in c.devices.values())
    return (devices, sorted(c.held.items()), sorted(c.overcommitted), c.fingerprint(), c.has_room(),
            [a.model_dump() if a is not None else None for a in answers])


def _apply(live: Cluster, active: dict[int, Job], yielded: set[int], step: tuple[str, int, int, bool],
           next_id: int) -> None:
    kind, a, b, flag = step
    ids = list(active)
    if kind in ("start", "fail_start"):
        j = _request(next_id, a, b)
        alloc = live.place(j, mps_any_uid=flag)
        if alloc is not None:
            live.commit(j, alloc)  # the pass commits what it starts
            if kind == "start":  # else the engine could not start it: it is not in the next snapshot
                active[j.id] = _running(j, alloc)
    elif kind == "end" and ids:
        jid = ids[a % len(ids)]
        del active[jid]
        yielded.discard(jid)
    elif kind == "yield" and ids:
        jid = ids[a % len(ids)]
        if active[jid].allocation is not None and active[jid].allocation.share is not None:  # type: ignore[union-attr]
            yielded.add(jid)
    elif kind == "resume" and yielded:
        jid = sorted(yielded)[a % len(yielded)]
        if flag:
            live.unpause(jid)  # the pass resumed it (the engine then reports it no longer yielded)
        yielded.discard(jid)
    elif kind == "pause_live" and ids:
        live.pause(ids[a % len(ids)])  # a what-if on the live view (sync must undo it)
    elif kind == "move_last" and ids:
        jid = ids[a % len(ids)]
        active[jid] = active.pop(jid)  # the engine lists it last now (e.g. requeued and restarted)
    elif kind == "realloc" and ids:
        jid = ids[a % len(ids)]
        j = active[jid]
        live_alloc = live.place(j, mps_any_uid=True)  # where the engine restarted it (outside a pass)
        if live_alloc is not None:
            active[jid] = _running(j, live_alloc)
    elif kind == "adopt_overfull":
        # an allocation made outside the scheduler, possibly breaking the rules (reported, kept)
        uuid = ("GPU-0000", "GPU-0001", "MIG-a", "GPU-0003")[b % 4]
        j = _request(next_id, a, b)
        share = 0.9 if flag else None
        alloc = Allocation(devices=[AllocatedDevice(uuid=uuid, gpu_index=0, kind="gpu")], compute_fraction=1.0,
                           share=share, gpu_mem_mib=70000 if flag else None)
        active[j.id] = _running(j, alloc)


@settings(max_examples=500, deadline=None)
@given(steps)
def test_synced_cluster_equals_a_fresh_build(seq: list[tuple[str, int, int, bool]]) -> None:
    active: dict[int, Job] = {}
    yielded: set[int] = set()
    live = Cluster.build(GPUS, [], share_modes=MODES)
    what_if: tuple[Cluster, object] | None = None
    for n, step in enumerate(seq):
        _apply(live, active, yielded, step, 100 + n)
        if what_if is not None:  # copies share devices until one side writes: the live side's
            assert state(what_if[0]) == what_if[1]  # changes since must not show in the copy
        snapshot = tuple(active.values())
        fresh = Cluster.build(GPUS, snapshot, share_modes=MODES, yielded=frozenset(yielded))
        if not sync(live, snapshot, frozenset(yielded)):
            live = Cluster.build(GPUS, snapshot, share_modes=MODES, yielded=frozenset(yielded))
        assert state(live, ask=n % 3 == 2) == state(fresh, ask=n % 3 == 2)
        assert live.violations() == fresh.violations()
        # a reservation's what-if: release the first jobs on a copy; the live view must not see it
        probe = live.copy()
        for jid in list(probe.held)[: 1 + n % 3]:
            probe.release(jid)
        assert state(live, ask=False) == state(fresh, ask=False)
        what_if = (probe, state(probe))


def test_sync_with_nothing_changed_keeps_the_memos() -> None:
    c = Cluster.build(GPUS, [], share_modes=MODES)
    j = job(1, gpus=1)
    alloc = c.place(j)
    assert alloc is not None
    c.commit(j, alloc)
    snapshot = (_running(j, alloc),)
    assert sync(c, snapshot, frozenset())
    fp = c.fingerprint()
    assert sync(c, snapshot, frozenset())  # the next pass, nothing changed
    assert c.fingerprint() is fp


def test_sync_refuses_jobs_that_stay_in_another_order() -> None:
    c = Cluster.build(GPUS, [], share_modes=MODES)
    a, b = job(1, share=0.3, uid=1), job(2, share=0.3, uid=1)
    for j in (a, b):
        alloc = c.place(j)
        assert alloc is not None
        c.commit(j, alloc)
    ra, rb = (_running(j, c_alloc) for j, c_alloc in ((a, _alloc_of(c, 1)), (b, _alloc_of(c, 2))))
    assert not sync(c, (rb, ra), frozenset())  # sums would be taken in another order: rebuild


def _alloc_of(c: Cluster, jid: int) -> Allocation:
    return next(e[1] for e in c.applied if e[0] == jid)


def test_a_failed_placement_stays_failed_after_a_commit_but_not_after_a_release() -> None:
    c = Cluster.build(GPUS[:1], [])
    first, second = job(1, gpus=1), job(2, gpus=1)
    alloc = c.place(first)
    assert alloc is not None
    c.commit(first, alloc)
    assert c.place(second) is None
    c.release(1)
    assert c.place(second) is not None  # the memo of the failure did not survive the release


def test_a_share_suspended_in_place_does_not_make_the_share_running_beside_it_look_over_full() -> None:
    """A 0.1 share yielded its compute to a 1.0 share on a timeslice device (the engine keeps its
    memory and slot). Listed after the running one, it used to be counted in full before the pause
    took it off, and the device was reported over-full; found by the random-workload property test
    in test_scheduler.py. Built fresh or synced, in either order, nothing is over-full."""
    dev = [AllocatedDevice(uuid="GPU-0001", gpu_index=1, kind="gpu")]
    running = _running(job(1, share=1.0, mem=100, uid=1), Allocation(devices=dev, compute_fraction=1.0, share=1.0,
                                                                      gpu_mem_mib=100))
    paused = _running(job(2, share=0.1, mem=100, uid=1), Allocation(devices=dev, compute_fraction=0.1, share=0.1,
                                                                     gpu_mem_mib=100))
    for order in ((running, paused), (paused, running)):
        built = Cluster.build(GPUS, list(order), share_modes=MODES, yielded=frozenset({2}))
        assert built.overcommitted == set()
        assert built.devices["GPU-0001"].used_fraction == 1.0
        live = Cluster.build(GPUS, [], share_modes=MODES)
        assert sync(live, order, frozenset({2}))
        assert state(live, ask=False) == state(built, ask=False)
    over = Cluster.build(GPUS, [running, _running(job(3, share=0.1, mem=100, uid=1), paused.allocation)],  # type: ignore[arg-type]
                         share_modes=MODES)
    assert over.overcommitted == {"GPU-0001"}  # both running: over-full indeed
