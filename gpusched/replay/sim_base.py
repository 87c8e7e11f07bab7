"""The replay's state and its progress model: jobs and the devices they hold, how fast each runs
next to its co-residents (interference), and the segments the metrics read (sim.py drives it).

Split from the event loop (sim.py) so that a job's speed, and how its work and its allocated
fraction are accounted, read in one place.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from gpusched.gpu.amdsmi import AmdSmiBackend
from gpusched.gpu.backend import Gpu
from gpusched.gpu.nvml import NvmlBackend
from gpusched.gpu.profiles import place_layout
from gpusched.gpu.simamdsmi import SimAmdSmi
from gpusched.gpu.simnvml import SimNVML
from gpusched.model import Allocation, Job, JobSpec, JobState, Transition
from gpusched.policy import Incremental, LearnsRunTimes, is_incremental
from gpusched.replay.policies import Interference, Planner, PolicySetup
from gpusched.replay.trace import TraceJob
from gpusched.replay.vendor import is_amd

END, READY, ARRIVAL, WAKE = 0, 1, 2, 3
EPS = 1e-9
MAX_ROUNDS = 5  # plans at one instant (after MIG changes / preemptions), as the engine does
PID_BASE = 100_000  # simulated process ids for jobs on MIG instances


Segment = tuple[float, float, float]  # (from, to, allocated compute fraction of a GPU)


@dataclass(slots=True)
class Run:
    """A job holding devices: progress (seconds of work at speed 1), speed, and its device groups."""

    job_id: int
    work_left: float
    deadline: float  # start + time limit, inf without one
    ready_at: float  # makes no progress before this (its MIG instance is being created)
    since: float
    speed: float = 1.0
    frac: float = 0.0
    seg_start: float = 0.0
    version: int = 0
    groups: tuple[str, ...] = ()  # interference groups it belongs to
    dyn_frac: bool = False  # time-sliced whole GPUs: its share of the GPU changes with co-residents
    pid: int | None = None


@dataclass(slots=True)
class SimResult:
    """Everything the metrics need from one policy's run."""

    policy: str
    node: str
    jobs: list[Job]
    segments: dict[int, list[Segment]]
    capacity_gpus: float
    plan_us: list[float]
    mig_reconfigurations: int
    mig_errors: list[str]
    unsatisfiable: int
    stuck: int  # jobs still pending when nothing was left to happen (a policy that can never run them)
    start: float
    end: float
    wall_s: float
    timeline: list[tuple[float, float]] = field(default_factory=list)  # (time, allocated GPUs)
    requested: dict[int, float] = field(default_factory=dict)  # job -> GPU-seconds the trace asked for
    expected: dict[int, float] = field(default_factory=dict)  # job -> run-time estimate at its last start


class SimBase:
    """What a replay holds and how its jobs progress; the event loop is `sim.Simulator`."""

    def __init__(self, policy: PolicySetup, jobs: Sequence[TraceJob], interference: Interference) -> None:
        self.policy = policy
        self.trace = list(jobs)
        self.inter = interference
        node = policy.node
        self.sim: SimNVML | SimAmdSmi
        self.backend: NvmlBackend | AmdSmiBackend
        if is_amd(node.models):  # logical GPUs through the real AmdSmiBackend (replay/vendor.py)
            self.sim = SimAmdSmi(list(node.models), seed=0)
            self.backend = AmdSmiBackend(self.sim)
        else:
            self.sim = SimNVML(list(node.models), seed=0)
            self.backend = NvmlBackend(self.sim)
        for index in sorted(node.mig_enabled):
            self.backend.set_mig_mode(index, True)
        for index, layout in node.static_layouts.items():
            for profile, start in place_layout(node.models[index], list(layout)):
                self.backend.create_instance(index, profile, start)
        self.gpus: tuple[Gpu, ...] = self.backend.inventory().gpus
        self.share_modes: dict[str, str] = {}
        if node.share_mode != "exclusive":
            self.share_modes = {g.uuid: node.share_mode for g in self.gpus if not g.mig_enabled}
        self.planner: Planner = policy.make_planner()
        # What the planner can do besides plan (gpusched/policy.py), asked once: keep its own queue
        # (then it is told of arrivals and requeues, and shown no pending jobs), learn from ends.
        planner = self.planner
        self.queue: Incremental | None = (planner if is_incremental(planner) and isinstance(planner, Incremental)
                                          else None)
        self.learner: LearnsRunTimes | None = planner if isinstance(planner, LearnsRunTimes) else None
        self.now = 0.0
        self.jobs: dict[int, Job] = {}
        self.pending: dict[int, Job] = {}
        self.active: dict[int, Job] = {}
        self.runs: dict[int, Run] = {}
        self.durations: dict[int, float] = {}
        self.segments: dict[int, list[Segment]] = {}
        self.groups: dict[str, set[int]] = {}
        self.events: list[tuple[float, int, int, int, int]] = []
        self.seq = itertools.count()
        self.plan_us: list[float] = []
        self.reconfigs = 0
        self.mig_errors: list[str] = []
        self.unsatisfiable = 0
        self.ready_at: dict[str, float] = {}  # MIG uuid -> when it exists
        self.busy_until: dict[int, float] = {}  # GPU index -> end of its MIG operations
        self.idle_since: dict[str, float] = {}  # MIG uuid -> idle since (for wake-ups)
        self.last_change: dict[int, float] = {}
        self.wakes: set[float] = set()
        self.timeline: list[tuple[float, float]] = []
        self.allocated = 0.0
        self.uids: dict[str, int] = {}
        self.requested: dict[int, float] = {}
        self.restoring: set[int] = set()  # checkpointed jobs: their next start restores them
        self.yielded: set[int] = set()  # shares suspended in place: memory held, no progress, no compute
        self.expected: dict[int, float] = {}

    # ---- building jobs ---------------------------------------------------------------------------
    def _make_job(self, jid: int, tj: TraceJob) -> Job:
        uid = self.uids.setdefault(tj.user, 20000 + len(self.uids))
        spec = JobSpec(argv=["replay", tj.name], cwd="/", request=self.policy.convert(tj), name=tj.name[:128],
                       time_limit_s=tj.time_limit_s, job_class=tj.job_class, requeue=tj.requeue,
                       precision=tj.precision)
        return Job(id=jid, uid=uid, gid=uid, user=tj.user, spec=spec, state=JobState.PENDING,
                   submitted_at=tj.submit_s, history=[Transition(state=JobState.PENDING, at=tj.submit_s,
                                                                 reason="submitted")])

    def _set(self, job: Job, state: JobState, reason: str, **update: object) -> Job:
        new = job.model_copy(update={"state": state, "history": [*job.history, Transition(
            state=state, at=self.now, reason=reason)], **update})
        self.jobs[job.id] = new
        return new

    def _push(self, at: float, kind: int, a: int = 0, b: int = 0) -> None:
        heapq.heappush(self.events, (at, kind, next(self.seq), a, b))

    def _groups_of(self, job: Job, alloc: Allocation) -> tuple[tuple[str, ...], bool]:
        """Interference groups: time-sliced GPUs, or the MPS / time-slice device a share sits on."""
        if self.policy.node.timeslice:
            return tuple(f"ts:{u}" for u in alloc.uuids), True
        if alloc.share is not None:
            mode = self.share_modes.get(alloc.uuids[0], "mps")
            return tuple(f"{'ts' if mode == 'timeslice' else 'mps'}:{u}" for u in alloc.uuids), False
        return (), False

    # ---- progress --------------------------------------------------------------------------------
    def _advance(self, run: Run) -> None:
        since = max(run.since, run.ready_at)
        if self.now > since:
            run.work_left = max(0.0, run.work_left - run.speed * (self.now - since))
        run.since = max(run.since, self.now)

    def _speed_frac(self, run: Run) -> tuple[float, float]:
        speed = 1.0
        fracs: list[float] = []
        for g in run.groups:
            members = self.groups.get(g, ())
            k = len(members)
            if g.startswith("ts:"):
                if k >= 2:
                    speed = min(speed, (1 - self.inter.timeslice_overhead) / k)
                fracs.append(1.0 / max(k, 1))
            elif k >= 2:
                # One MPS server per user: a user's clients run side by side (mps_slowdown), and the
                # servers of u users time-slice like separate processes ((1 - overhead) / u).
                me = self.jobs[run.job_id].user
                users = {self.jobs[m].user for m in members}
                same = sum(1 for m in members if self.jobs[m].user == me)
                g_speed = (1 - self.inter.mps_slowdown) if same >= 2 else 1.0
                if len(users) >= 2:
                    g_speed *= (1 - self.inter.timeslice_overhead) / len(users)
                speed = min(speed, g_speed)
        frac = sum(fracs) if run.dyn_frac else run.frac
        return speed, frac

    def _close_segment(self, run: Run) -> None:
        if self.now > run.seg_start:
            self.segments[run.job_id].append((run.seg_start, self.now, run.frac))
        run.seg_start = self.now

    def _regroup(self, groups: tuple[str, ...], also: Run | None = None) -> None:
        """Co-residents changed: bring their progress to now, then new speeds and end events."""
        affected = {jid for g in groups for jid in self.groups.get(g, ())}
        if also is not None:
            affected.add(also.job_id)
        for jid in sorted(affected):
            run = self.runs.get(jid)
            if run is None:
                continue
            self._advance(run)
            speed, frac = self._speed_frac(run)
            if frac != run.frac:
                self._close_segment(run)
                self.allocated += frac - run.frac
                run.frac = frac
            run.speed = speed
            run.version += 1
            finish = max(self.now, run.ready_at) + (run.work_left / speed if speed > 0 else math.inf)
            self._push(min(finish, run.deadline), END, jid, run.version)

    def _release(self, jid: int) -> Job:
        self.yielded.discard(jid)
        run = self.runs.pop(jid)
        self._advance(run)
        self._close_segment(run)
        self.allocated -= run.frac
        job = self.active.pop(jid)
        if run.pid is not None:
            self.sim.remove_process(run.pid)
            assert job.allocation is not None
            for d in job.allocation.devices:
                if d.kind == "mig":
                    self.idle_since[d.uuid] = self.now
        for g in run.groups:
            self.groups[g].discard(jid)
        self._regroup(run.groups)
        return job

