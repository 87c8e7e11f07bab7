"""`--partition` jobs and demand-driven AMD partition modes (core/partplan.py, sched_mig._plan_partitions),
against the simulated amdsmi backend: its inventory is what the scheduler sees, and the actions are
applied to it as the daemon would."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpusched.core.actions import SetPartitionMode, Snapshot, StartJob
from gpusched.core.migplan import MigPolicy
from gpusched.core.placement import unsatisfiable_reason
from gpusched.core.queue import request_fraction
from gpusched.core.sched_core import SchedulerConfig
from gpusched.core.scheduler import Scheduler
from gpusched.gpu.amdsmi import open_amd_backend
from gpusched.gpu.backend import Gpu, GpuBackend
from gpusched.model import Allocation, Job, JobSpec, JobState, PartitionRequest
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


def test_demand_larger_than_one_gpu_changes_as_many_gpus_as_needed_and_keeps_wanted_modes() -> None:
    node = AmdNode("MI300X:3", MigPolicy(min_idle_s=0.0, min_reconfig_interval_s=0.0))
    node.pending[1] = pjob(1, "DPX", gpus=2)
    node.pending[2] = pjob(2, "DPX", gpus=2)
    node.pending[3] = pjob(3, "SPX")  # backfills onto one SPX GPU at once
    before = {g.uuid: g.partition.physical_index for g in node.gpus if g.partition is not None}
    acts = node.plan(0.0)
    changes = [a for a in acts if isinstance(a, SetPartitionMode)]
    assert [a.compute for a in changes] == ["DPX", "DPX"]  # 4 DPX logical GPUs wanted: two physical GPUs
    spx = before[node.active[3].allocation.devices[0].uuid]  # type: ignore[union-attr]
    assert {a.physical_index for a in changes} == {0, 1, 2} - {spx}  # not the GPU the SPX job runs on
    node.plan(1.0)
    assert set(node.active) == {1, 2, 3}


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
            if isinstance(a, SetPartitionMode):
                assert a.physical_index not in phys_busy | started
        for jid in list(node.active)[: len(node.active) // 2]:  # some jobs end
            del node.active[jid]
