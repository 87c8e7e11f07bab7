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
) -> list[SetPartitionMode]:
    """Mode changes for `wanted` (compute mode -> logical GPUs pending jobs still need), modes
    taken in `order` (the fairness head's first).

    A candidate comes after the last physical GPU with a logical GPU `busy` or `blocked` (drained,
    kept for interactive work, share-configured: `[gpus.N]` names a logical index, which a change
    before it would move), has been idle `min_idle_s` and unchanged `min_reconfig_interval_s`.
    Among candidates one whose current mode no pending job wants goes first, then the lowest index
    (which leaves the most GPUs after it free to change later), and changes continue until the
    mode's need is covered.
    """
    changes: list[SetPartitionMode] = []
    used: set[int] = set()
    # the last physical GPU a job, a drain or a per-index setting holds: only GPUs after it may change
    pinned = max((p.index for p in phys if any(u in busy or u in blocked for u in p.uuids)), default=-1)

    def switchable(p: Physical) -> bool:
        since = idle_since.get(p.index)
        return (p.index > pinned and p.index not in used and since is not None and now - since >= policy.min_idle_s
                and now - last_reconfig.get(p.index, -math.inf) >= policy.min_reconfig_interval_s)

    for mode in order:
        need = wanted.get(mode, 0)
        while need > 0:
            cands = [p for p in phys if p.compute != mode and switchable(p)
                     and memory_for(p.model, mode, p.memory) is not None]
            if not cands:
                break
            best = min(cands, key=lambda p: (wanted.get(p.compute, 0) > 0, p.index))
            memory = memory_for(best.model, mode, best.memory)
            assert memory is not None
            used.add(best.index)
            need -= PARTITIONS_PER_MODE[mode]
            changes.append(SetPartitionMode(
                best.index, mode, memory,
                f"{wanted[mode]} logical GPU(s) in {mode} mode wanted by pending jobs; GPU {best.index} "
                f"has been idle in {best.compute} mode"))
    return changes
