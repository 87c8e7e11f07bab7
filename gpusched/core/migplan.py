"""MIG layout planning: demand-driven repartitioning of `dynamic` GPUs, and declarative `mig apply`.

A GPU has 8 memory slices and 7 compute slices; an instance occupies the memory slices of one of its
profile's placements (`{starts}:size`, gpu/profiles.py) and the driver refuses overlaps and more
than `max_instances` of a profile. Every plan here is checked against exactly those rules, and never
touches an instance a job is using (the driver would refuse with IN_USE anyway, but only after
the engine had started destroying other instances of the plan).

Fragmentation: among valid placements we pick the one that loses the least *headroom*, compared
largest profile first. Headroom of a layout is, per profile, how many more instances of it could
still be created; placing a 1g at start 6 rather than 0 keeps a 4g (start 0) possible, and placing
it on a GPU that is already split keeps whole 7g GPUs for 7g demand.

Hysteresis, because a reconfiguration costs seconds and throws away a warm instance: an idle
instance may be destroyed only after `min_idle_s` of idleness, only when no pending job wants its
profile, and a GPU is changed by destroys at most once per `min_reconfig_interval_s`. Creating an
instance in unused space is always allowed: it destroys nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from gpusched.gpu.backend import Gpu, Instance
from gpusched.gpu.profiles import COMPUTE_SLICES, MODELS, MigProfile, profile_by_name


@dataclass(frozen=True, slots=True)
class MigPolicy:
    """Reconfiguration damping for dynamic GPUs (config `[mig]`)."""

    min_idle_s: float = 300.0  # an idle instance must be idle this long before it may go
    min_reconfig_interval_s: float = 600.0  # between reconfigurations that destroy, per GPU
    # A dynamic GPU may leave MIG mode when whole-GPU work needs it and come back for MIG work, only
    # while it is idle (no instance busy, no job on it), with the same damping as above.
    toggle_mode: bool = True


@dataclass(frozen=True, slots=True)
class Slot:
    """An instance in a layout (existing or planned): profile name, start, memory size, compute."""

    profile: str
    start: int
    size: int
    slices: int
    uuid: str | None = None  # None for a planned instance

    @property
    def cells(self) -> range:
        return range(self.start, self.start + self.size)


@dataclass(frozen=True, slots=True)
class PlannedCreate:
    gpu_index: int
    profile: str
    start: int
    reason: str


@dataclass(frozen=True, slots=True)
class PlannedDestroy:
    uuid: str
    gpu_index: int
    reason: str


@dataclass(frozen=True, slots=True)
class MigPlan:
    """Apply destroys before creates: the creates use the space the destroys free."""

    destroys: tuple[PlannedDestroy, ...] = ()
    creates: tuple[PlannedCreate, ...] = ()
    unmet: tuple[str, ...] = ()  # demanded profiles no dynamic GPU can make room for now

    @property
    def gpus_changed(self) -> set[int]:
        return {c.gpu_index for c in self.creates} | {d.gpu_index for d in self.destroys}


@dataclass(frozen=True, slots=True)
class LayoutChange:
    """Result of `plan_layout_change`: what to keep, destroy and create, or why it is refused."""

    keep: tuple[str, ...] = ()
    destroy: tuple[str, ...] = ()
    create: tuple[tuple[str, int], ...] = ()  # (profile, start)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _profiles(model: str) -> dict[str, MigProfile]:
    m = MODELS.get(model)
    return {p.name: p for p in m.profiles} if m is not None else {}


def slot_of(inst: Instance, model: str) -> Slot:
    """An existing instance as a layout slot (compute slices from the table, else from its name)."""
    p = _profiles(model).get(inst.profile)
    slices = p.slices if p is not None else int(inst.profile.split("g", 1)[0])
    return Slot(inst.profile, inst.start, inst.size, slices, inst.uuid)


def layout_violations(model: str, slots: Sequence[Slot]) -> list[str]:
    """Every way `slots` breaks the driver's rules on `model` (empty list: a valid layout)."""
    profs = _profiles(model)
    out: list[str] = []
    used: dict[int, str] = {}
    counts: dict[str, int] = {}
    compute = 0
    for s in slots:
        p = profs.get(s.profile)
        if p is None:
            out.append(f"{model} has no profile {s.profile}")
            continue
        if s.start not in p.starts or s.size != p.memory_slices:
            out.append(f"{s.profile} cannot start at {s.start}:{s.size} (valid: {set(p.starts)}:{p.memory_slices})")
        for c in s.cells:
            if c in used:
                out.append(f"{s.profile}@{s.start} overlaps {used[c]} at memory slice {c}")
            used[c] = f"{s.profile}@{s.start}"
        counts[s.profile] = counts.get(s.profile, 0) + 1
        compute += p.slices
    for name, n in counts.items():
        if n > profs[name].max_instances:
            out.append(f"{n} x {name} exceeds its limit of {profs[name].max_instances}")
    if compute > COMPUTE_SLICES:
        out.append(f"{compute} compute slices exceed {COMPUTE_SLICES}")
    return out


def _fits(p: MigProfile, start: int, slots: Sequence[Slot]) -> bool:
    """Could one more `p` start at `start` next to `slots`?"""
    cells = set(range(start, start + p.memory_slices))
    if any(c in cells for s in slots for c in s.cells):
        return False
    if sum(1 for s in slots if s.profile == p.name) >= p.max_instances:
        return False
    return sum(s.slices for s in slots) + p.slices <= COMPUTE_SLICES


def headroom(model: str, slots: Sequence[Slot]) -> tuple[int, ...]:
    """Per profile, largest first: how many more instances could still be made (each alone)."""
    out: list[int] = []
    profs = sorted(_profiles(model).values(), key=lambda p: (-p.memory_slices, -p.slices, p.profile_id))
    for p in profs:
        cur = list(slots)
        n = 0
        for start in p.starts:  # equal-length intervals: left-to-right greedy is maximal
            if _fits(p, start, cur):
                cur.append(Slot(p.name, start, p.memory_slices, p.slices))
                n += 1
        out.append(n)
    return tuple(out)


@dataclass(slots=True)
class _GpuLayout:
    gpu: Gpu
    slots: list[Slot]
    destroyable: dict[str, Slot] = field(default_factory=dict)  # uuid -> slot
    may_destroy: bool = True


def plan_dynamic(
    gpus: Sequence[Gpu],
    busy: AbstractSet[str],
    demand: Sequence[str],
    *,
    pending_profiles: AbstractSet[str] = frozenset(),
    claimed: AbstractSet[str] = frozenset(),
    idle_since: Mapping[str, float] | None = None,
    last_reconfig: Mapping[int, float] | None = None,
    now: float = 0.0,
    policy: MigPolicy | None = None,
    unschedulable: frozenset[str] = frozenset(),
) -> MigPlan:
    """Create (and, when needed, destroy idle instances for) the demanded profiles on dynamic GPUs.

    `gpus` are the dynamic, MIG-enabled GPUs; `demand` lists one profile per pending MIG job that
    found no free instance, in fairness order; `pending_profiles` every profile any pending job
    asks for (their idle instances are kept, unless `claimed` for the fairness head, which needs
    them gone). Greedy per demand item: the option destroying the
    fewest memory slices wins, then the one losing the least headroom, then the lowest GPU index.
    """
    pol = policy or MigPolicy()
    idle = idle_since or {}
    last = last_reconfig or {}
    layouts: list[_GpuLayout] = []
    for gpu in gpus:
        if not gpu.mig_enabled or gpu.uuid in unschedulable or gpu.model not in MODELS:
            continue
        lay = _GpuLayout(gpu, [slot_of(i, gpu.model) for i in gpu.instances])
        lay.may_destroy = now - last.get(gpu.index, float("-inf")) >= pol.min_reconfig_interval_s
        for inst in gpu.instances:
            since = idle.get(inst.uuid)
            if (inst.uuid not in busy and inst.uuid not in unschedulable and since is not None
                    and now - since >= pol.min_idle_s
                    and (inst.profile not in pending_profiles or inst.uuid in claimed)):
                lay.destroyable[inst.uuid] = slot_of(inst, gpu.model)
        layouts.append(lay)

    destroys: list[PlannedDestroy] = []
    creates: list[PlannedCreate] = []
    unmet: list[str] = []
    for want in demand:
        best: tuple[tuple[object, ...], _GpuLayout, int, list[Slot]] | None = None
        for lay in layouts:
            p = _profiles(lay.gpu.model).get(want)
            if p is None:
                continue
            before = headroom(lay.gpu.model, lay.slots)
            for start in p.starts:
                cells = set(range(start, start + p.memory_slices))
                victims = [s for s in lay.slots if set(s.cells) & cells]
                if victims and (not lay.may_destroy or any(
                        s.uuid is None or s.uuid not in lay.destroyable for s in victims)):
                    continue
                rest = [s for s in lay.slots if s not in victims]
                if not _fits(p, start, rest):
                    continue
                after = headroom(lay.gpu.model, [*rest, Slot(p.name, start, p.memory_slices, p.slices)])
                loss = tuple(b - a for b, a in zip(before, after, strict=True))
                key = (sum(s.size for s in victims), loss, lay.gpu.index, start)
                if best is None or key < best[0]:
                    best = (key, lay, start, victims)
        if best is None:
            unmet.append(want)
            continue
        _, lay, start, victims = best
        p = _profiles(lay.gpu.model)[want]
        for v in victims:
            assert v.uuid is not None
            lay.slots.remove(v)
            del lay.destroyable[v.uuid]
            destroys.append(PlannedDestroy(v.uuid, lay.gpu.index,
                                           f"idle {v.profile}@{v.start} makes room for a {want}"))
        lay.slots.append(Slot(want, start, p.memory_slices, p.slices))
        why = "pending demand" + (" after destroying idle instances" if victims else " in unused space")
        creates.append(PlannedCreate(lay.gpu.index, want, start, f"{want} for {why}"))
    return MigPlan(tuple(destroys), tuple(creates), tuple(unmet))


def _place_all(
    profs: Sequence[MigProfile], fixed: Sequence[Slot]
) -> list[int] | None:
    """Starts for every profile in `profs` around `fixed` (backtracking, large first), or None."""
    order = sorted(range(len(profs)), key=lambda i: (-profs[i].memory_slices, -profs[i].slices, i))
    starts: dict[int, int] = {}

    def search(k: int, slots: list[Slot]) -> bool:
        if k == len(order):
            return True
        p = profs[order[k]]
        for start in p.starts:
            if _fits(p, start, slots):
                starts[order[k]] = start
                if search(k + 1, [*slots, Slot(p.name, start, p.memory_slices, p.slices)]):
                    return True
        return False

    if not search(0, list(fixed)):
        return None
    return [starts[i] for i in range(len(profs))]


def layout_error(model: str, target_profiles: Sequence[str]) -> str | None:
    """Why `target_profiles` can never be a layout of one `model` GPU (unknown profile, too much memory
    or compute, no placement), or None: what a config's `mig = [...]` is checked against."""
    return plan_layout_change(model, [], frozenset(), target_profiles).error


def plan_layout_change(
    model: str,
    current_instances: Sequence[Instance],
    busy_uuids: Mapping[str, int] | AbstractSet[str],
    target_profiles: Sequence[str],
) -> LayoutChange:
    """The smallest change from `current_instances` to a GPU holding exactly `target_profiles`.

    Instances already matching the target are kept (busy ones always; idle ones unless keeping them
    blocks the rest), only idle instances are destroyed, and if a busy instance would have to go the
    change is refused with a message naming it and, when `busy_uuids` maps uuid -> job id, its job.
    """
    try:
        profs = [profile_by_name(model, name) for name in target_profiles]
    except ValueError as exc:
        return LayoutChange(error=str(exc))
    bad = layout_violations(model, [Slot(p.name, p.starts[0], p.memory_slices, p.slices) for p in profs])
    bad = [b for b in bad if "exceeds" in b or "compute" in b]
    if bad:
        return LayoutChange(error=f"target layout is not valid on {model}: {'; '.join(bad)}")
    if _place_all(profs, []) is None:
        return LayoutChange(error=f"target layout {list(target_profiles)} does not fit on one {model}")

    def who(inst: Instance) -> str:
        job = busy_uuids.get(inst.uuid) if isinstance(busy_uuids, Mapping) else None
        return f"{inst.profile} {inst.uuid} at {inst.start}" + (f" (job {job})" if job is not None else "")

    want: dict[str, int] = {}
    for p in profs:
        want[p.name] = want.get(p.name, 0) + 1
    busy = [i for i in current_instances if i.uuid in busy_uuids]
    idle = [i for i in current_instances if i.uuid not in busy_uuids]
    for inst in busy:
        if want.get(inst.profile, 0) <= 0:
            return LayoutChange(error=f"busy instance {who(inst)} is not in the target layout; "
                                      "wait for its job or cancel it first")
        want[inst.profile] -= 1
    matching = [i for i in idle if want.get(i.profile, 0) > 0]
    # Keep as many matching idle instances as the target allows, trying larger keep-sets first.
    best: tuple[list[Instance], list[tuple[str, int]]] | None = None
    n = len(matching)
    subsets = sorted(range(1 << n), key=lambda m: -bin(m).count("1"))
    for mask in subsets:
        keep_idle = [matching[i] for i in range(n) if mask >> i & 1]
        left = dict(want)
        for inst in keep_idle:
            left[inst.profile] -= 1
        if any(k < 0 for k in left.values()):
            continue
        fixed = [slot_of(i, model) for i in [*busy, *keep_idle]]
        if layout_violations(model, fixed):
            continue
        rest = [profile_by_name(model, name) for name, k in left.items() for _ in range(k)]
        starts = _place_all(rest, fixed)
        if starts is not None:
            best = (keep_idle, [(p.name, s) for p, s in zip(rest, starts, strict=True)])
            break
    if best is None:
        names = ", ".join(who(i) for i in busy) or "none"
        return LayoutChange(error=f"target layout {list(target_profiles)} cannot be built around the busy "
                                  f"instances: {names}")
    keep_idle, create = best
    kept = {i.uuid for i in [*busy, *keep_idle]}
    return LayoutChange(
        keep=tuple(i.uuid for i in current_instances if i.uuid in kept),
        destroy=tuple(i.uuid for i in current_instances if i.uuid not in kept),
        create=tuple(create),
    )

