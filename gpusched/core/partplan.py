"""AMD partition modes from demand: which idle physical GPU changes to which compute mode.

On AMD Instinct a physical GPU is split by its compute mode (SPX 1, DPX 2, QPX 4, CPX 8 logical GPUs)
and a `--partition MODE` job runs on one logical GPU of that mode. A mode change needs every logical
GPU of the physical GPU idle (the driver refuses otherwise) and renumbers them, so it is damped like
dynamic MIG with the same `[mig]` settings (core/migplan.py `MigPolicy`): the physical GPU must have
been idle for `min_idle_s` and not changed for `min_reconfig_interval_s`.

A change also renumbers every logical GPU after the changed one: logical GPUs are numbered in
amdsmi's enumeration order, physical GPUs in BDF order and partitions within each, and a job's
`ROCR_VISIBLE_DEVICES` holds those numbers. A process the job starts after a renumbering would open
another job's logical GPU. So a physical GPU changes only while every physical GPU after it is idle
and unconfigured too; jobs on GPUs before it keep their numbers.

Pure: the scheduler (sched_mig.py `_plan_partitions`) passes in what is busy, the idle timers and now.
docs/scheduling.md, "AMD partitions".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from gpusched.core.actions import SetPartitionMode
from gpusched.core.migplan import MigPolicy
from gpusched.gpu.amd_profiles import AMD_MODELS, PARTITIONS_PER_MODE
from gpusched.gpu.backend import Gpu


@dataclass(frozen=True, slots=True)
class Physical:
    """One AMD physical GPU as its logical GPUs show it."""

    index: int
    model: str
    compute: str
    memory: str
    uuids: tuple[str, ...]  # its logical GPUs


def physical_gpus(gpus: Iterable[Gpu]) -> list[Physical]:
    """The physical GPUs behind the logical ones, in index order (NVIDIA GPUs have no partition)."""
    found: dict[int, tuple[Gpu, list[str]]] = {}
    for g in gpus:
        if g.partition is not None:
            found.setdefault(g.partition.physical_index, (g, []))[1].append(g.uuid)
    out: list[Physical] = []
    for index in sorted(found):
        g, uuids = found[index]
        assert g.partition is not None
        out.append(Physical(index, g.model, g.partition.compute_mode, g.partition.memory_mode, tuple(uuids)))
    return out


def track_idle(phys: Sequence[Physical], busy: AbstractSet[str], idle_since: dict[int, float], now: float) -> None:
    """Since when each physical GPU has had no job on any of its logical GPUs (updated in place)."""
    present = set()
    for p in phys:
        present.add(p.index)
        if any(u in busy for u in p.uuids):
            idle_since.pop(p.index, None)
        else:
            idle_since.setdefault(p.index, now)
    for gone in [i for i in idle_since if i not in present]:
        del idle_since[gone]


def memory_for(model: str, compute: str, current: str) -> str | None:
    """The memory mode to run `compute` with: the current one when the model allows it, else the
    first one it allows; None when the model does not offer `compute` (or is unknown)."""
    am = AMD_MODELS.get(model)
    if am is None or compute not in am.combinations:
        return None
    return current if am.is_valid(compute, current) else am.combinations[compute][0]


@dataclass(frozen=True, slots=True)
class HeadNeed:
    """The blocked fairness head, when it is a `--partition` job: its mode, and whether the node
    must change a GPU for it (fewer logical GPUs of its mode exist, busy or not, than it asks)."""

    mode: str
    short: bool


def plan_partitions(
    phys: Sequence[Physical],
    wanted: Mapping[str, int],
    order: Sequence[str],
    *,
    busy: AbstractSet[str],
    blocked: AbstractSet[str],
    idle_since: Mapping[int, float],
    last_reconfig: Mapping[int, float],
    now: float,
    policy: MigPolicy,
    head: HeadNeed | None = None,
    whole_needed: int = 0,
) -> list[SetPartitionMode]:
    """Mode changes for `wanted` (compute mode -> logical GPUs pending jobs still need), modes
    taken in `order` (the fairness head's first).

    A candidate comes after the last physical GPU with a logical GPU `busy` or `blocked` (drained,
    share-configured or kept for interactive work by `[gpus.N]`, which names a logical index that a
    change before it would move), has been idle `min_idle_s` and unchanged `min_reconfig_interval_s`.
    A change that also changes the memory mode needs the whole node idle (the driver reloads).

    The head is served first and never undone: no GPU in its mode changes to another, and while it
    is `short` no mode but its own is served (the GPUs it claimed are draining for it). No change
    leaves fewer logical GPUs than `whole_needed`, the largest pending `--gpus N` (that job would
    become unsatisfiable through the scheduler's own doing).

    Among candidates one whose current mode no pending job wants goes first, then the lowest index
    (which leaves the most GPUs after it free to change later), and changes continue until the
    mode's need is covered.
    """
    changes: list[SetPartitionMode] = []
    used: set[int] = set()
    # the last physical GPU a job, a drain or a per-index setting holds: only GPUs after it may change
    pinned = max((p.index for p in phys if any(u in busy or u in blocked for u in p.uuids)), default=-1)
    node_idle = not any(u in busy for p in phys for u in p.uuids)
    total = sum(len(p.uuids) for p in phys)

    def switchable(p: Physical, mode: str) -> bool:
        since = idle_since.get(p.index)
        memory = memory_for(p.model, mode, p.memory)
        after = total - len(p.uuids) + PARTITIONS_PER_MODE[mode]
        return (p.compute != mode and memory is not None and (memory == p.memory or node_idle)
                and (head is None or p.compute != head.mode)
                and (after >= whole_needed or total < whole_needed)
                and p.index > pinned and p.index not in used and since is not None and now - since >= policy.min_idle_s
                and now - last_reconfig.get(p.index, -math.inf) >= policy.min_reconfig_interval_s)

    for mode in order:
        if head is not None and head.short and mode != head.mode:
            continue
        need = wanted.get(mode, 0)
        while need > 0:
            cands = [p for p in phys if switchable(p, mode)]
            if not cands:
                break
            best = min(cands, key=lambda p: (wanted.get(p.compute, 0) > 0, p.index))
            memory = memory_for(best.model, mode, best.memory)
            assert memory is not None
            used.add(best.index)
            total += PARTITIONS_PER_MODE[mode] - len(best.uuids)
            need -= PARTITIONS_PER_MODE[mode]
            changes.append(SetPartitionMode(
                best.index, mode, memory,
                f"{wanted[mode]} logical GPU(s) in {mode} mode wanted by pending jobs; GPU {best.index} "
                f"has been idle in {best.compute} mode"))
    return changes


def logical_in_mode(phys: Sequence[Physical], mode: str, blocked: AbstractSet[str]) -> int:
    """Logical GPUs the node has in `mode`, busy or not, leaving out physical GPUs `blocked` holds."""
    return sum(len(p.uuids) for p in phys if p.compute == mode and not any(u in blocked for u in p.uuids))


def claim_for_head(phys: Sequence[Physical], mode: str, gpus: int, *, blocked: AbstractSet[str]) -> frozenset[str]:
    """The logical GPUs backfill must leave alone so that a blocked `--partition` head whose mode
    the node lacks gets it: else each logical GPU that frees is refilled in the same pass and the
    physical GPU is never idle long enough to change (the counterpart of dynamic MIG's claim).

    GPUs are taken from the last one back (a change needs every GPU after it idle too), skipping
    those already in the mode, until the mode's count covers `gpus`; the claim is every logical GPU
    from the first one taken to the end, or, when a taken GPU must change its memory mode too, the
    whole node. Empty when the node has enough of the mode already (the head waits for jobs to
    end) or cannot make enough (a drained or configured GPU is in the way)."""
    need = gpus - logical_in_mode(phys, mode, blocked)
    if need <= 0:
        return frozenset()
    first: int | None = None
    whole_node = False
    for p in reversed(phys):
        if need <= 0:
            break
        if any(u in blocked for u in p.uuids):
            return frozenset()  # it pins every GPU before it
        memory = memory_for(p.model, mode, p.memory)
        if p.compute == mode or memory is None:
            continue
        whole_node = whole_node or memory != p.memory
        need -= PARTITIONS_PER_MODE[mode]
        first = p.index
    if need > 0 or first is None:
        return frozenset()
    return frozenset(u for p in phys if whole_node or p.index >= first for u in p.uuids)
