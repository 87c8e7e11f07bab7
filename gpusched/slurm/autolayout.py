"""`gpusched slurm relayout NODE --auto`: a MIG layout for NODE from the jobs Slurm has pending.

Slurm knows what is waiting (`squeue --json`: `tres_per_node` such as `gres:gpu:1g.10gb:1`), and
gpusched knows how MIG instances fit; the plan is core/migplan's demand-driven one, the same the
standalone daemon uses for `mig = "dynamic"` GPUs, so instances of profiles that are still asked
for, and instances Slurm has given to a running job, are kept.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from gpusched.core.migplan import MigPolicy, plan_dynamic
from gpusched.gpu.backend import Gpu, Instance
from gpusched.gpu.profiles import MODELS, profile_by_name
from gpusched.protocol import GpusResult
from gpusched.slurm.gresconf import GresDevice

WAITING_FOR_GPUS = frozenset({"Resources", "Priority"})  # not Dependency, held, limits: a layout won't help
_GRES = re.compile(r"^gres[:/]gpu:([^:=]+)[:=]([0-9]+)$")


def pending_demand(squeue: Mapping[str, Any], node_profiles: Iterable[str]) -> list[str]:
    """One profile per MIG instance pending jobs ask for per node, in Slurm's order, limited to
    profiles NODE's GPUs have."""
    known = set(node_profiles)
    demand: list[str] = []
    for job in squeue.get("jobs", []):
        if job.get("job_state") != "PENDING" or job.get("state_reason") not in WAITING_FOR_GPUS:
            continue
        for term in str(job.get("tres_per_node") or "").split(","):
            m = _GRES.match(term.strip())
            if m and m.group(1) in known:
                demand.extend([m.group(1)] * int(m.group(2)))
    return demand


def busy_uuids(gres_used: str, devs: list[GresDevice]) -> set[str]:
    """Devices Slurm has given to jobs, from `GresUsed=gpu:3g.40gb:1(IDX:3),...` and the GRES map."""
    busy: set[str] = set()
    for idx_list in re.findall(r"\(IDX:([0-9,\-]+)\)", gres_used):
        for part in idx_list.split(","):
            lo, _, hi = part.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                if i < len(devs):
                    busy.add(devs[i].uuid)
    return busy


def _backend_gpus(result: GpusResult) -> list[Gpu]:
    """The inventory as the planner's types (MIG GPUs of known models only)."""
    gpus = []
    for g in result.gpus:
        if not g.mig_enabled or g.model not in MODELS:
            continue
        instances = tuple(
            Instance(uuid=i.uuid, gpu_index=g.index, profile=i.profile,
                     profile_id=profile_by_name(g.model, i.profile).profile_id, gi_id=i.gi_id or 0, ci_id=0,
                     start=i.start, size=i.size, memory_mib=i.memory_mib, sm_count=i.sm_count)
            for i in g.instances)
        gpus.append(Gpu(index=g.index, uuid=g.uuid, name=g.name, model=g.model, memory_total_mib=g.memory_total_mib,
                        sm_count=g.sm_count, mig_enabled=True, mig_pending=g.mig_pending, instances=instances))
    return gpus


def node_profiles(result: GpusResult) -> set[str]:
    return {p.name for g in result.gpus if g.mig_enabled and g.model in MODELS for p in MODELS[g.model].profiles}


def plan(result: GpusResult, demand: list[str], busy: set[str]) -> tuple[dict[int, list[str]], list[str]]:
    """(GPU -> new layout for each GPU that changes, profiles that still do not fit)."""
    gpus = _backend_gpus(result)
    idle = {i.uuid: float("-inf") for g in gpus for i in g.instances if i.uuid not in busy}
    # A job waiting for a profile NODE has idle is waiting for something else (CPUs, another node):
    # each idle instance answers one such request, and only the rest is demand.
    demand = list(demand)
    for gpu in gpus:
        for inst in gpu.instances:
            if inst.uuid in idle and inst.profile in demand:
                demand.remove(inst.profile)
    if not demand:
        return {}, []
    # The node is drained before anything changes, so no damping: every idle instance may go,
    # except those of a profile that is itself still asked for.
    mig = plan_dynamic(gpus, frozenset(busy), demand, pending_profiles=frozenset(demand), idle_since=idle,
                       now=0.0, policy=MigPolicy(min_idle_s=0.0, min_reconfig_interval_s=0.0))
    gone = {d.uuid for d in mig.destroys}
    layouts: dict[int, list[str]] = {}
    for gpu in gpus:
        created = [c.profile for c in mig.creates if c.gpu_index == gpu.index]
        if created or any(i.uuid in gone for i in gpu.instances):
            layouts[gpu.index] = [i.profile for i in gpu.instances if i.uuid not in gone] + created
    return layouts, list(mig.unmet)
