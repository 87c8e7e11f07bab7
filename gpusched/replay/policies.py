"""The policy set a trace is replayed under and the node each one gets (the config file they read is
replayconfig.py).

Every policy is (a) how the node's GPUs are set up (MIG off / static MIG layouts / dynamic MIG, share
modes), (b) how a trace request becomes a request that policy can serve (a Kubernetes device plugin
cannot give 0.3 of a GPU, so fifo-whole rounds it up), and (c) the planner that decides. gpusched is
the production `core.Scheduler` itself; the baselines are `core.FifoScheduler` or a small FCFS
planner with the same `plan(snapshot, now) -> [Action]` shape, so the simulator treats all alike.
Every planner, built-in or a site's `package.module:Class`, is loaded and built through
gpusched/policies.py; a plug-in gets the fifo-whole node (docs/policies.md).
docs/replay.md documents every choice made here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from gpusched.core.scheduler import Action, FailJob, Snapshot, StartJob
from gpusched.gpu.profiles import MODELS, MigProfile, place_layout, profile_by_name
from gpusched.model import (
    ACTIVE_STATES,
    AllocatedDevice,
    Allocation,
    JobState,
    MigRequest,
    PartitionRequest,
    ShareRequest,
    WholeRequest,
)
from gpusched.policies import PolicyFactory, load_policy
from gpusched.policy import PolicyContext
from gpusched.replay.replayconfig import (
    STATIC_CLASSES,
    Interference,
    ReplayConfig,
    ReplayConfigError,
    config_from_dict,
    load_config,
)
from gpusched.replay.trace import Request, TraceJob
from gpusched.replay.vendor import PolicySkipped, check_model, check_one_vendor, is_amd, share_mode, skip_reason

__all__ = [
    "POLICIES",
    "STATIC_CLASSES",
    "Interference",
    "NodePlan",
    "Planner",
    "PolicySetup",
    "PolicySkipped",
    "ReplayConfig",
    "ReplayConfigError",
    "TimesliceFifo",
    "config_from_dict",
    "load_config",
    "parse_gpus",
    "setup",
    "static_layout",
    "timeslice_fifo",
    "user_weights",
]

POLICIES: tuple[str, ...] = ("gpusched", "fifo-whole", "fifo-timeslice", "static-mig")


# ---- planners ---------------------------------------------------------------------------------

class Planner(Protocol):
    """What the simulator calls: core.Scheduler, core.FifoScheduler and TimesliceFifo all fit."""

    def plan(self, snapshot: Snapshot, now: float) -> list[Action]: ...


class TimesliceFifo:
    """FCFS onto time-sliced GPUs: the NVIDIA device plugin with `timeSlicing.replicas`.

    Each GPU takes at most `replicas` jobs, with no memory check (time-slicing has no memory
    isolation); a job asking for N GPUs takes one replica on N different GPUs. New jobs go to the
    least crowded GPUs. Strict FCFS: the first job that does not fit stops the pass.
    """

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas

    def plan(self, snapshot: Snapshot, now: float) -> list[Action]:
        load: dict[str, int] = {g.uuid: 0 for g in snapshot.gpus if g.uuid not in snapshot.unschedulable}
        index = {g.uuid: g.index for g in snapshot.gpus}
        for job in snapshot.active:
            if job.state in ACTIVE_STATES and job.allocation is not None:
                for u in job.allocation.uuids:
                    if u in load:
                        load[u] += 1
        actions: list[Action] = []
        for job in snapshot.pending:
            if job.state is not JobState.PENDING:
                continue
            need = job.spec.request.gpus if isinstance(job.spec.request, WholeRequest) else 1
            if need > len(load):
                actions.append(FailJob(job.id, f"unsatisfiable: asks for {need} GPUs, the node has {len(load)}"))
                continue
            free = sorted((n, index[u], u) for u, n in load.items() if n < self.replicas)
            if len(free) < need:
                break
            chosen = [u for _, _, u in free[:need]]
            for u in chosen:
                load[u] += 1
            frac = float(need) if isinstance(job.spec.request, WholeRequest) else _fraction(job.spec.request)
            actions.append(StartJob(job.id, Allocation(
                devices=[AllocatedDevice(uuid=u, gpu_index=index[u], kind="gpu") for u in chosen],
                compute_fraction=frac), "first come, first served (time-sliced)"))
        return actions


def timeslice_fifo(context: PolicyContext) -> TimesliceFifo:
    """`fifo-timeslice` as gpusched/policies.py builds it: `replicas` from the context's options."""
    return TimesliceFifo(int(context.options.get("replicas", 4)))


def _fraction(req: MigRequest | ShareRequest | PartitionRequest) -> float:
    if isinstance(req, ShareRequest):
        return req.fraction
    if isinstance(req, PartitionRequest):
        return float(req.gpus)  # this baseline has no partitions: a logical GPU counts whole
    return int(req.profile.split("g", 1)[0]) / 7


# ---- node set-ups -----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class NodePlan:
    """How the simulated GPUs start: MIG-off share modes, static layouts, scheduler-managed MIG."""

    models: tuple[str, ...]
    static_layouts: Mapping[int, tuple[str, ...]] = field(default_factory=dict)  # index -> profiles
    dynamic: frozenset[int] = frozenset()  # MIG on, empty, changed by the scheduler
    share_mode: str = "exclusive"  # of the MIG-off GPUs
    timeslice: bool = False  # every GPU time-sliced (fifo-timeslice)
    checkpoint: bool = False  # preemption may checkpoint whole-GPU jobs (cuda-checkpoint)
    description: str = ""

    @property
    def mig_enabled(self) -> frozenset[int]:
        return frozenset(self.static_layouts) | self.dynamic


@dataclass(frozen=True, slots=True)
class PolicySetup:
    """One policy ready to run: its node, how trace requests become its requests, and its planner."""

    name: str
    node: NodePlan
    convert: Callable[[TraceJob], Request]
    make_planner: Callable[[], Planner]


def parse_gpus(spec: str) -> tuple[str, ...]:
    """`MODEL[:COUNT][,...]` (the `--sim` syntax) -> one model key per GPU index."""
    models: list[str] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        if "@" in part:  # gpuschedd --sim takes a start mode; the replay has no model for it
            raise ValueError(f"bad --gpus part {part!r}: partition modes are not replayed (a trace's run times are "
                             "whole-GPU run times; docs/replay.md, \"AMD Instinct nodes\"); drop the @MODE")
        name, _, count_s = part.partition(":")
        check_model(name)
        try:
            count = int(count_s) if count_s else 1
        except ValueError:
            raise ValueError(f"bad --gpus part {part!r}: the count must be a whole number") from None
        if not 1 <= count <= 64:
            raise ValueError(f"bad --gpus part {part!r}: the count must be 1..64")
        models.extend([name] * count)
    if not models:
        raise ValueError("empty --gpus; e.g. H100-80GB:8")
    check_one_vendor(spec, models)
    return tuple(models)


def _ladder(model: str) -> dict[str, MigProfile]:
    """The static-MIG class profiles of a model: smallest-memory 1g, 2g and 3g (no +me variants)."""
    out: dict[str, MigProfile] = {}
    for slices in (1, 2, 3):
        cands = [p for p in MODELS[model].profiles if p.slices == slices and "+" not in p.name]
        out[f"{slices}g"] = min(cands, key=lambda p: (p.memory_mib, p.profile_id))
    return out


def static_layout(model: str, cls: str) -> tuple[str, ...]:
    """The fixed layout of a static-MIG class: 7x1g, 3x2g+1g, 2x3g; `whole` is MIG off (empty)."""
    lad = _ladder(model)
    layouts = {"1g": [lad["1g"].name] * 7, "2g": [lad["2g"].name] * 3 + [lad["1g"].name],
               "3g": [lad["3g"].name] * 2, "whole": []}
    names = layouts[cls]
    place_layout(model, names)  # raises if a table ever makes the layout invalid
    return tuple(names)


def _fits(p: MigProfile, model: str, fraction: float, mem: int) -> bool:
    return p.sm_count / MODELS[model].sm_count >= fraction - 1e-9 and p.memory_mib >= mem


def _static_class(job: TraceJob, model: str) -> str:
    """The smallest static-MIG class that gives the job at least what it asked for."""
    req = job.request
    if isinstance(req, WholeRequest):
        return "whole"
    lad = _ladder(model)
    if isinstance(req, MigRequest):
        try:
            want = profile_by_name(model, req.profile)
        except ValueError:
            return "whole"
        frac, mem = want.sm_count / MODELS[model].sm_count, want.memory_mib
    else:
        frac, mem = req.fraction, req.gpu_mem_mib
    for cls in ("1g", "2g", "3g"):
        if _fits(lad[cls], model, frac, mem):
            return cls
    return "whole"


def _apportion(n: int, demand: Mapping[str, float]) -> dict[str, int]:
    """Split n GPUs by demand: one per class with demand (largest first), the rest one at a time
    to the class furthest below its proportional quota."""
    classes = sorted((c for c, d in demand.items() if d > 0), key=lambda c: -demand[c])[:n]
    out = dict.fromkeys(classes, 1)
    total = sum(demand[c] for c in classes)
    for _ in range(n - len(classes)):
        c = max(classes, key=lambda c: demand[c] / total * n - out[c])
        out[c] += 1
    return out


def _mig_for_share(job: TraceJob, model: str, max_waste: float) -> str | None:
    """gpusched's Alibaba mapping: the smallest MIG profile giving >= the fraction and memory, if it
    wastes at most `max_waste` of a GPU's SMs; None means serve it as an MPS share."""
    req = job.request
    if not isinstance(req, ShareRequest) or not job.flexible:
        return None
    gpu_sms = MODELS[model].sm_count
    cands = sorted((p for p in MODELS[model].profiles if "+" not in p.name and p.slices < 7),
                   key=lambda p: (p.sm_count, p.memory_mib))
    for p in cands:
        if _fits(p, model, req.fraction, req.gpu_mem_mib):
            return p.name if p.sm_count / gpu_sms - req.fraction <= max_waste + 1e-9 else None
    return None


def setup(name: str, models: Sequence[str], jobs: Sequence[TraceJob], config: ReplayConfig) -> PolicySetup:
    """The named policy (a built-in or package.module:Class) on a node of `models` (one per GPU),
    sized where needed from `jobs`. PolicyError (a ValueError) for one that does not load,
    PolicySkipped for a built-in that has no meaning on this node (static-mig on AMD)."""
    models = tuple(models)
    factory = load_policy(name, field="--policy")
    skipped = skip_reason(name, models) if factory.builtin else None
    if skipped is not None:
        raise PolicySkipped(name, skipped)
    if not factory.builtin:
        return _plugin(factory, models, config)
    if name == "gpusched":
        return _gpusched(factory, models, jobs, config)
    if name == "fifo-whole":
        node = NodePlan(models, description=f"{len(models)} whole GPUs, MIG off, exclusive")
        return PolicySetup(name, node, _round_up, lambda: factory.make(PolicyContext(config.scheduler)))
    if name == "fifo-timeslice":
        node = NodePlan(models, timeslice=True,
                        description=f"{len(models)} GPUs time-sliced, <= {config.timeslice_replicas} jobs each")
        context = PolicyContext(config.scheduler, {"replicas": config.timeslice_replicas})
        return PolicySetup(name, node, _keep, lambda: factory.make(context))
    return _static_mig(factory, models, jobs, config)


def _plugin(factory: PolicyFactory, models: tuple[str, ...], config: ReplayConfig) -> PolicySetup:
    """A site's policy: whole GPUs, MIG off, exclusive, shares and MIG asks rounded up to one GPU (as
    fifo-whole), so its figures compare with the baselines' and gpusched's on the same trace."""
    node = NodePlan(models, description=f"{len(models)} whole GPUs, MIG off, exclusive (plug-in {factory.spec})")
    context = PolicyContext(config.scheduler, dict(config.policy_options))
    return PolicySetup(factory.name, node, _round_up, lambda: factory.make(context))


def _round_up(job: TraceJob) -> Request:
    """fifo-whole: the device plugin hands out whole GPUs only; a share or MIG ask gets one GPU."""
    req = job.request
    return req if isinstance(req, WholeRequest) else WholeRequest(gpus=1)


def _keep(job: TraceJob) -> Request:
    return job.request


def _static_mig(factory: PolicyFactory, models: tuple[str, ...], jobs: Sequence[TraceJob],
                config: ReplayConfig) -> PolicySetup:
    model = models[-1]
    if config.static_layouts is not None:
        if len(config.static_layouts) != len(models):
            raise ReplayConfigError(f"[replay] static_layouts lists {len(config.static_layouts)} GPUs, "
                                    f"the node has {len(models)}")
        classes = list(config.static_layouts)
    else:
        per_gpu = {"1g": 1 / 7, "2g": 1 / 3, "3g": 1 / 2}
        demand: dict[str, float] = dict.fromkeys(STATIC_CLASSES, 0.0)
        for j in jobs:
            cls = _static_class(j, model)
            units = float(j.request.gpus) if isinstance(j.request, WholeRequest) else per_gpu.get(cls, 1.0)
            demand[cls] += units * j.duration_s
        counts = _apportion(len(models), demand) if any(demand.values()) else {"whole": len(models)}
        # Whole GPUs first (lowest indices), then the layouts from large to small slices.
        classes = [c for c in ("whole", "3g", "2g", "1g") for _ in range(counts.get(c, 0))]
    layouts = {i: static_layout(models[i], c) for i, c in enumerate(classes) if c != "whole"}
    offered = {c for c in classes}

    def convert(job: TraceJob) -> Request:
        req = job.request
        if isinstance(req, WholeRequest):
            return req
        cls = _static_class(job, model)
        order = ["1g", "2g", "3g", "whole"]
        for c in order[order.index(cls):]:
            if c in offered:
                return WholeRequest(gpus=1) if c == "whole" else MigRequest(profile=_ladder(model)[c].name)
        return MigRequest(profile=_ladder(model)[cls].name)

    desc = ", ".join(f"{classes.count(c)} x {c if c == 'whole' else '/'.join(static_layout(model, c))}"
                     for c in ("whole", "3g", "2g", "1g") if c in offered)
    node = NodePlan(models, static_layouts=layouts, description=f"static MIG: {desc}")
    return PolicySetup("static-mig", node, convert, lambda: factory.make(PolicyContext(config.scheduler)))


def _gpusched(factory: PolicyFactory, models: tuple[str, ...], jobs: Sequence[TraceJob],
              config: ReplayConfig) -> PolicySetup:
    n = len(models)
    model = models[-1]
    amd = is_amd(models)
    shares = share_mode(config.share_mode, models)
    mig_units = 0.0
    total = 0.0
    explicit_mig = False
    max_whole = 0
    others = False
    for j in jobs:
        prof = None if amd else _mig_for_share(j, model, config.mig_max_waste)
        if isinstance(j.request, MigRequest):
            explicit_mig = True
            mig_units += j.gpu_demand * j.duration_s
        elif prof is not None:
            mig_units += profile_by_name(model, prof).slices / 7 * j.duration_s
        else:
            others = True
            if isinstance(j.request, WholeRequest):
                max_whole = max(max_whole, j.request.gpus)
        total += j.gpu_demand * j.duration_s
    note = ""
    if amd:
        m, note = 0, f"AMD has no MIG; shares {shares}"
    elif config.mig_gpus is not None:
        m = min(config.mig_gpus, n)
        note = "set by config"
    elif not explicit_mig:
        # Flexible shares are packed with MPS unless mig_gpus is set: serving them with dynamic MIG
        # measured worse on gpushare100 (7 MIG GPUs: useful utilization 0.29; none: 0.455), because
        # MIG profiles fragment and reconfiguration waits out its hysteresis (docs/replay.md).
        m, note = 0, "no MIG jobs; flexible shares packed with MPS"
    else:
        m = round(n * mig_units / total) if total > 0 else 0
        m = max(m, 1)
        if others and (n > 1 or not config.scheduler.mig.toggle_mode):
            # (with toggle_mode an idle dynamic GPU leaves MIG mode for whole-GPU work: a 1-GPU node
            # keeps its one GPU dynamic, or its MIG jobs could never run)
            m = min(m, n - 1)
        note = "sized from MIG demand"
    dynamic = frozenset(range(n - m, n))
    use_mig = bool(dynamic)

    def convert(job: TraceJob) -> Request:
        if use_mig:
            prof = _mig_for_share(job, model, config.mig_max_waste)
            if prof is not None:
                return MigRequest(profile=prof)
        return job.request

    weights = dict(config.scheduler.fairness.weights)
    for j in jobs:  # trace weights, unless the config names the user
        if j.weight is not None and j.user not in weights:
            weights[j.user] = j.weight
    sched_cfg = replace(config.scheduler, fairness=replace(config.scheduler.fairness, weights=weights))
    desc = (f"{n - m} MIG-off GPUs ({shares} shares), {m} dynamic-MIG GPUs ({note})")
    if amd:
        desc = f"{n} whole logical GPUs ({shares} shares; no MIG, no MPS, no cuda-checkpoint on AMD)"
    node = NodePlan(models, dynamic=dynamic, share_mode=shares, checkpoint=config.checkpoint and not amd,
                    description=desc)
    return PolicySetup("gpusched", node, convert, lambda: factory.make(PolicyContext(sched_cfg)))


def user_weights(jobs: Sequence[TraceJob], config: ReplayConfig) -> dict[str, float]:
    """Weight of every user for the fairness figures: config, then the trace, then the default."""
    fair = config.scheduler.fairness
    out: dict[str, float] = {}
    for j in jobs:
        if j.user in out:
            continue
        w = fair.weights.get(j.user, j.weight if j.weight is not None else fair.default_weight)
        out[j.user] = float(w)
    return out
