"""`--partition` jobs and demand-driven AMD partition modes (core/partplan.py, sched_mig._plan_partitions),
against the simulated amdsmi backend: its inventory is what the scheduler sees, and the actions are
applied to it as the daemon would."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpusched.core.actions import FailJob, SetPartitionMode, Snapshot, StartJob
from gpusched.core.fairshare import FairnessConfig
from gpusched.core.migplan import MigPolicy
from gpusched.core.placement import unsatisfiable_reason
from gpusched.core.queue import request_fraction
from gpusched.core.sched_core import SchedulerConfig
from gpusched.core.scheduler import Scheduler
from gpusched.gpu.amdsmi import open_amd_backend
from gpusched.gpu.backend import Gpu, GpuBackend
from gpusched.model import AllocatedDevice, Allocation, Job, JobSpec, JobState, PartitionRequest, WholeRequest
from tests.core.helpers import gpu

POLICY = MigPolicy(min_idle_s=60.0, min_reconfig_interval_s=600.0)


def pjob(jid: int, mode: str = "CPX", gpus: int = 1, user: str = "alice") -> Job:
    spec = JobSpec(argv=["x"], cwd="/tmp", request=PartitionRequest(mode=mode, gpus=gpus))  # type: ignore[arg-type]
    return Job(id=jid, uid=1000, gid=100, user=user, spec=spec, state=JobState.PENDING, submitted_at=0.0)


def running(j: Job, alloc: Allocation, at: float = 0.0) -> Job:
    return j.model_copy(update={"state": JobState.RUNNING, "allocation": alloc, "started_at": at})


class AmdNode:
    """Scheduler + simulated MI300X node; applies SetPartitionMode like the daemon does."""

    def __init__(self, spec: str = "MI300X:2", policy: MigPolicy = POLICY) -> None:
        self.backend: GpuBackend = open_amd_backend(spec)
        self.sched = Scheduler(SchedulerConfig(mig=policy))
        self.pending: dict[int, Job] = {}
        self.active: dict[int, Job] = {}
        self.changes: list[SetPartitionMode] = []

    @property
    def gpus(self) -> tuple[Gpu, ...]:
        return self.backend.inventory().gpus

    def plan(self, now: float) -> list[object]:
        snap = Snapshot(gpus=self.gpus, pending=tuple(self.pending.values()), active=tuple(self.active.values()))
        acts = self.sched.plan(snap, now)
        for a in acts:
            if isinstance(a, StartJob):
                self.active[a.job_id] = running(self.pending.pop(a.job_id), a.allocation, now)
            elif isinstance(a, SetPartitionMode):
                self.changes.append(a)
                self.backend.set_partition_mode(a.physical_index, a.compute, a.memory)
        return list(acts)

    def mode_of(self, physical: int) -> str:
        return next(g.partition.compute_mode for g in self.gpus
                    if g.partition is not None and g.partition.physical_index == physical)


def test_cpx_job_waits_for_min_idle_then_an_idle_spx_gpu_changes_mode_and_the_job_runs_there() -> None:
    node = AmdNode()
    node.pending[1] = pjob(1)
    assert not node.plan(0.0)  # idle since 0: not long enough
    assert not node.plan(59.0)
    acts = node.plan(60.0)
    assert [(a.physical_index, a.compute, a.memory) for a in acts if isinstance(a, SetPartitionMode)] == \
        [(0, "CPX", "NPS1")]
    assert node.mode_of(0) == "CPX" and node.mode_of(1) == "SPX"  # one change covers the one job
    acts = node.plan(61.0)  # the next pass sees the new inventory
    (start,) = [a for a in acts if isinstance(a, StartJob)]
    (dev,) = start.allocation.devices
    placed = next(g for g in node.gpus if g.uuid == dev.uuid)
    assert placed.partition is not None and placed.partition.compute_mode == "CPX"
    assert start.allocation.compute_fraction == 1 / 8  # charged an eighth of the physical GPU


def test_a_busy_physical_gpu_is_never_changed() -> None:
    node = AmdNode("MI300X:1")
    (g,) = node.gpus
    node.pending[1] = pjob(1, "SPX")
    node.plan(0.0)
    assert 1 in node.active  # the SPX job runs on the only physical GPU
    node.pending[2] = pjob(2, "CPX")
    for t in (100.0, 1000.0, 5000.0):
        assert not [a for a in node.plan(t) if isinstance(a, SetPartitionMode)]
    assert node.mode_of(0) == "SPX"
    del node.active[1]  # the job ends: the GPU must now stay idle min_idle_s before it changes
    assert not [a for a in node.plan(5001.0) if isinstance(a, SetPartitionMode)]
    assert [a.compute for a in node.plan(5061.0) if isinstance(a, SetPartitionMode)] == ["CPX"]
    assert g.uuid not in {x.uuid for x in node.gpus}  # the logical GPUs came back with new ids


def test_reconfig_interval_is_respected_per_physical_gpu() -> None:
    node = AmdNode("MI300X:1", MigPolicy(min_idle_s=0.0, min_reconfig_interval_s=600.0))
    node.pending[1] = pjob(1, "CPX")
    node.plan(0.0)
    assert node.mode_of(0) == "CPX"
    node.plan(1.0)
    assert 1 in node.active
    del node.active[1]
    node.pending[2] = pjob(2, "QPX")
    assert not [a for a in node.plan(100.0) if isinstance(a, SetPartitionMode)]  # changed 100 s ago
    assert [a.compute for a in node.plan(600.0) if isinstance(a, SetPartitionMode)] == ["QPX"]


def test_demand_larger_than_one_gpu_changes_as_many_gpus_as_needed_lowest_first() -> None:
    node = AmdNode("MI300X:3", MigPolicy(min_idle_s=0.0, min_reconfig_interval_s=0.0))
    node.pending[1] = pjob(1, "DPX", gpus=2)
    node.pending[2] = pjob(2, "DPX", gpus=2)
    acts = node.plan(0.0)
    changes = [(a.physical_index, a.compute) for a in acts if isinstance(a, SetPartitionMode)]
    assert changes == [(0, "DPX"), (1, "DPX")]  # 4 DPX logical GPUs wanted: two physical GPUs, no third
    assert node.mode_of(2) == "SPX"
    node.plan(1.0)
    assert set(node.active) == {1, 2}


def test_a_job_on_the_last_gpu_pins_every_gpu_before_it() -> None:
    """The SPX job, alone, goes to GPU 2 (best fit by NUMA node: GPU 2 is alone on node 1). Changing
    GPU 0 or 1 would renumber its logical GPU, so the DPX demand that comes next waits until it
    ends; then the lowest GPU changes."""
    node = AmdNode("MI300X:3", MigPolicy(min_idle_s=0.0, min_reconfig_interval_s=0.0))
    node.pending[1] = pjob(1, "SPX")
    (start,) = [a for a in node.plan(0.0) if isinstance(a, StartJob)]
    assert start.allocation.devices[0].gpu_index == 2
    node.pending[2] = pjob(2, "DPX", gpus=2)
    for t in (1.0, 100.0):
        assert not [a for a in node.plan(t) if isinstance(a, SetPartitionMode)]
    del node.active[1]
    assert [(a.physical_index, a.compute) for a in node.plan(101.0) if isinstance(a, SetPartitionMode)] == \
        [(0, "DPX")]


def test_backfill_keeps_off_the_gpus_a_blocked_partition_head_needs_changed() -> None:
    """The DPX head claims the last GPU (a change needs every GPU after it idle), so the SPX job
    behind it backfills onto GPU 0 instead, and GPU 1 can change for the head at once."""
    node = AmdNode("MI300X:3", MigPolicy(min_idle_s=0.0, min_reconfig_interval_s=0.0))
    node.pending[1] = pjob(1, "DPX", gpus=2)
    node.pending[2] = pjob(2, "SPX", user="bob")
    acts = node.plan(0.0)
    (start,) = [a for a in acts if isinstance(a, StartJob)]
    assert start.job_id == 2 and start.allocation.devices[0].gpu_index == 0
    assert [(a.physical_index, a.compute) for a in acts if isinstance(a, SetPartitionMode)] == [(1, "DPX")]
    node.plan(1.0)
    assert 1 in node.active


def test_partition_requests_are_refused_on_nvidia_and_for_modes_a_model_lacks() -> None:
    why = unsatisfiable_reason(PartitionRequest(mode="CPX"), [gpu(0)])
    assert why is not None and "no partitions on NVIDIA; use --mig" in why
    amd = open_amd_backend("MI300X:1").inventory().gpus
    assert unsatisfiable_reason(PartitionRequest(mode="CPX"), amd) is None
    too_many = unsatisfiable_reason(PartitionRequest(mode="DPX", gpus=3), amd)
    assert too_many is not None and "at most 2" in too_many
    assert request_fraction(PartitionRequest(mode="QPX", gpus=2)) == 0.5


@settings(max_examples=40, deadline=None)
@given(modes=st.lists(st.sampled_from(["SPX", "DPX", "QPX", "CPX"]), min_size=1, max_size=12),
       steps=st.lists(st.floats(0.0, 50.0), min_size=1, max_size=6))
def test_property_no_mode_change_on_a_physical_gpu_with_a_job(modes: list[str], steps: list[float]) -> None:
    node = AmdNode("MI300X:2", MigPolicy(min_idle_s=10.0, min_reconfig_interval_s=20.0))
    for i, m in enumerate(modes):
        node.pending[i + 1] = pjob(i + 1, m)
    now = 0.0
    for dt in steps:
        now += dt
        phys_busy = {next(g.partition.physical_index for g in node.gpus if g.uuid == d.uuid and g.partition)
                     for j in node.active.values() if j.allocation for d in j.allocation.devices}
        before = {g.uuid: g.partition.physical_index for g in node.gpus if g.partition is not None}
        acts = node.plan(now)
        started = {before[d.uuid] for a in acts if isinstance(a, StartJob) for d in a.allocation.devices}
        for a in acts:
            if isinstance(a, SetPartitionMode):  # nor one before a busy GPU: it would renumber it
                assert a.physical_index > max(phys_busy | started, default=-1)
        for jid in list(node.active)[: len(node.active) // 2]:  # some jobs end
            del node.active[jid]


def test_a_gpu_before_a_busy_one_is_not_changed_since_the_change_would_renumber_the_busy_one() -> None:
    """Logical GPUs are numbered physical GPU by physical GPU: a change of GPU 0 moves GPU 1's
    numbers under the job running there (its ROCR_VISIBLE_DEVICES). GPU 0 waits until GPU 1 is idle."""
    node = AmdNode("MI300X:2", MigPolicy(min_idle_s=0.0, min_reconfig_interval_s=0.0))
    node.pending[1] = pjob(1, "SPX")
    node.pending[2] = pjob(2, "SPX")
    node.plan(0.0)
    assert set(node.active) == {1, 2}
    on_gpu0 = next(j for j in node.active.values() if j.allocation and j.allocation.devices[0].gpu_index == 0)
    del node.active[on_gpu0.id]  # GPU 0 is idle, GPU 1 still runs a job
    node.pending[3] = pjob(3, "CPX")
    for t in (10.0, 1000.0):
        assert not [a for a in node.plan(t) if isinstance(a, SetPartitionMode)]
    assert node.mode_of(0) == "SPX"
    node.active.clear()  # GPU 1's job ends: now GPU 0, the lowest, changes
    assert [(a.physical_index, a.compute) for a in node.plan(1001.0) if isinstance(a, SetPartitionMode)] == \
        [(0, "CPX")]
    node.plan(1002.0)
    assert 3 in node.active and node.active[3].allocation is not None


def test_a_gpu_after_a_busy_one_changes_and_the_busy_jobs_numbers_stay() -> None:
    node = AmdNode("MI300X:2", MigPolicy(min_idle_s=0.0, min_reconfig_interval_s=0.0))
    node.pending[1] = pjob(1, "SPX")
    node.plan(0.0)
    (held,) = node.active[1].allocation.devices  # type: ignore[union-attr]
    assert held.gpu_index == 0
    node.pending[2] = pjob(2, "CPX")
    assert [a.physical_index for a in node.plan(1.0) if isinstance(a, SetPartitionMode)] == [1]
    same = next(g for g in node.gpus if g.uuid == held.uuid)
    assert same.index == held.gpu_index  # the running job's ROCR_VISIBLE_DEVICES still names its GPU


def test_the_queue_keeps_the_partition_demand_as_jobs_come_and_go() -> None:
    from gpusched.core.fairshare import FairShare
    from gpusched.core.queue import RunQueue

    q = RunQueue(FairShare())
    q.submit(pjob(1, "CPX", gpus=3))
    q.submit(pjob(2, "CPX"))
    q.submit(pjob(3, "DPX", gpus=2))
    q.submit(pjob(1, "CPX", gpus=3))  # submitted again: replaced, not counted twice
    assert q.partition_demand() == {"CPX": 4, "DPX": 2}
    q.remove(3)
    q.remove(2)
    assert q.partition_demand() == {"CPX": 3}
    q.remove(1)
    q.remove(1)  # unknown now: nothing changes
    assert q.partition_demand() == {}
    whole = [Job(id=10 + i, uid=1000, gid=100, user="bob", submitted_at=0.0, state=JobState.PENDING,
                 spec=JobSpec(argv=["x"], cwd="/tmp", request=WholeRequest(gpus=n))) for i, n in enumerate((4, 16, 16))]
    for j in whole:
        q.submit(j)
    assert q.largest_whole() == 16
    q.remove(whole[1].id)
    assert q.largest_whole() == 16  # the other 16-GPU job is still pending
    q.remove(whole[2].id)
    assert q.largest_whole() == 4
    q.remove(whole[0].id)
    assert q.largest_whole() == 0


def test_a_partition_head_whose_mode_the_node_lacks_is_not_starved_by_a_stream_of_other_modes() -> None:
    """MI300X:1 in CPX, alice keeps eight CPX jobs queued, bob asks SPX. Bob's claim keeps alice's
    jobs off the GPU as they end, so it goes idle, changes after min_idle_s, and bob runs (before
    the claim, each freed CPX GPU was refilled in the same pass: 2,000 s later bob still waited)."""
    node = AmdNode("MI300X:1@CPX", MigPolicy(min_idle_s=5.0, min_reconfig_interval_s=0.0))
    ends: dict[int, float] = {}
    next_id = 0

    def add(user: str, mode: str) -> int:
        nonlocal next_id
        next_id += 1
        node.pending[next_id] = pjob(next_id, mode, user=user)
        return next_id

    for _ in range(8):
        add("alice", "CPX")
    bob = add("bob", "SPX")
    t = 0.0
    while bob not in node.active and t < 2000.0:
        while sum(j.user == "alice" for j in node.pending.values()) < 8:
            add("alice", "CPX")
        for jid in [j for j, end in ends.items() if end <= t]:
            node.active.pop(jid, None)
            del ends[jid]
        node.plan(t)
        ends.update({jid: t + 30.0 + jid % 7 for jid in node.active if jid not in ends})
        t += 1.0
    assert bob in node.active, f"bob still pending at {t:.0f} s"
    assert t < 60.0  # the longest CPX job (36 s), then min_idle_s
    assert [a.compute for a in node.changes] == ["SPX"]


def test_a_gpu_in_the_heads_mode_is_not_changed_for_a_job_behind_it() -> None:
    """The head wants both SPX GPUs; one is busy, the other idle in SPX. A CPX job behind it would
    have had the idle one changed to CPX, and a stream of them kept the head waiting for ever."""
    policy = MigPolicy(min_idle_s=0.0, min_reconfig_interval_s=0.0)
    node = AmdNode("MI300X:2", policy)
    # alice ahead of bob by fairness, whatever each asks
    node.sched = Scheduler(SchedulerConfig(mig=policy, fairness=FairnessConfig(weights={"alice": 10000, "bob": 1})))
    node.pending[1] = pjob(1, "SPX", user="carol")
    node.plan(0.0)
    node.pending[2] = pjob(2, "SPX", gpus=2, user="alice")
    node.pending[3] = pjob(3, "CPX", user="bob")
    for t in (1.0, 2.0, 50.0):
        assert not [a for a in node.plan(t) if isinstance(a, SetPartitionMode)]
    assert node.mode_of(1) == "SPX"
    node.active.clear()
    node.plan(51.0)
    assert 2 in node.active


def test_an_interactive_partition_job_on_an_idle_node_is_not_held_up_by_its_own_headroom() -> None:
    """The interactive headroom kept an idle CPX logical GPU, which pinned the only physical GPU:
    an interactive `--partition spx` job never started on an idle node (a batch one did)."""
    for job_class in ("batch", "interactive"):
        node = AmdNode("MI300X:1@CPX", MigPolicy(min_idle_s=5.0, min_reconfig_interval_s=0.0))
        j = pjob(1, "SPX")
        node.pending[1] = j.model_copy(update={"spec": j.spec.model_copy(update={"job_class": job_class})})
        for t in range(0, 60, 5):
            node.plan(float(t))
        assert 1 in node.active, job_class


def test_no_change_leaves_fewer_logical_gpus_than_a_pending_whole_job_asks() -> None:
    """`--gpus 16` was accepted on two CPX MI300X (16 logical GPUs); changing one to SPX for a
    `--partition spx` job left 9, and the scheduler then failed the whole job as unsatisfiable."""
    node = AmdNode("MI300X:2@CPX", MigPolicy(min_idle_s=0.0, min_reconfig_interval_s=0.0))
    node.pending[1] = pjob(1, "CPX", user="carol")
    node.plan(0.0)
    node.pending[2] = pjob(2, "SPX")
    whole = JobSpec(argv=["x"], cwd="/tmp", request=WholeRequest(gpus=16))
    node.pending[3] = Job(id=3, uid=1000, gid=100, user="bob", spec=whole, state=JobState.PENDING, submitted_at=1.0)
    for t in (1.0, 2.0, 3.0):
        acts = node.plan(t)
        assert not [a for a in acts if isinstance(a, (SetPartitionMode, FailJob))], acts
    del node.pending[3]  # without it, the SPX job gets its GPU
    assert [a.compute for a in node.plan(4.0) if isinstance(a, SetPartitionMode)] == ["SPX"]


def test_a_memory_mode_change_waits_for_the_whole_node_to_be_idle() -> None:
    """QPX/NPS4 -> SPX needs NPS1: the driver reloads, so every GPU of the node must be idle."""
    node = AmdNode("MI300X:2@QPX/NPS4", MigPolicy(min_idle_s=0.0, min_reconfig_interval_s=0.0))
    node.pending[1] = pjob(1, "QPX")
    node.plan(0.0)
    node.pending[2] = pjob(2, "SPX", user="bob")
    for t in (1.0, 10.0):
        assert not [a for a in node.plan(t) if isinstance(a, SetPartitionMode)]
    node.active.clear()
    assert [(a.compute, a.memory) for a in node.plan(11.0) if isinstance(a, SetPartitionMode)] == [("SPX", "NPS1")]


def test_a_running_job_on_a_device_the_inventory_does_not_list_stops_every_change() -> None:
    """(After a restart of the simulator, which forgets modes, a job's logical GPU may be gone from
    the inventory.) Nothing says which GPUs a change would renumber under it: none changes."""
    node = AmdNode("MI300X:2", MigPolicy(min_idle_s=0.0, min_reconfig_interval_s=0.0))
    ghost = Allocation(devices=[AllocatedDevice(uuid="gone-cpxnps1-3", gpu_index=3, kind="gpu")],
                       compute_fraction=0.125)
    node.active[9] = running(pjob(9, "CPX"), ghost)
    node.pending[1] = pjob(1, "CPX")
    for t in (0.0, 100.0):
        assert not [a for a in node.plan(t) if isinstance(a, SetPartitionMode)]
    del node.active[9]
    assert [a.compute for a in node.plan(101.0) if isinstance(a, SetPartitionMode)] == ["CPX"]


def test_partition_damping_survives_a_restart_and_a_reload() -> None:
    """min_reconfig_interval_s counted from a change made before the restart (the saved record
    holds `p<index>` beside MIG's GPU indices) and across a reload that rebuilds the scheduler."""
    policy = MigPolicy(min_idle_s=5.0, min_reconfig_interval_s=3600.0)
    node = AmdNode("MI300X:1", policy)
    node.pending[1] = pjob(1, "CPX")
    node.plan(0.0)
    node.plan(5.0)
    assert node.mode_of(0) == "CPX"
    saved = node.sched.export_mig_damping()
    assert saved == {"p0": 5.0}
    for how in ("restart", "reload"):
        fresh = Scheduler(SchedulerConfig(mig=policy))
        if how == "restart":
            fresh.load_mig_damping(saved)
        else:
            fresh.carry_over(node.sched)
        other = AmdNode("MI300X:1", policy)
        other.backend = node.backend
        other.sched = fresh
        other.pending[2] = pjob(2, "SPX", user="bob")
        assert not [a for t in range(6, 600, 30) for a in other.plan(float(t)) if isinstance(a, SetPartitionMode)]
        assert [a.compute for a in other.plan(3606.0) if isinstance(a, SetPartitionMode)] == ["SPX"], how
        other.backend.set_partition_mode(0, "CPX", "NPS1")  # back, for the next case
    fresh = Scheduler(SchedulerConfig(mig=policy))
    fresh.load_mig_damping({"0": 1.0, "p1": 2.0, "px": 3.0, "p2": True})  # type: ignore[dict-item]
    assert fresh.export_mig_damping() == {"0": 1.0, "p1": 2.0}
