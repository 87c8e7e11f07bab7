"""Per-user fair-share accounting in the shape of EEVDF (ARCHITECTURE.md §3).

Why EEVDF and not CFS: CFS couples latency to weight and forgives debt / grants sleeper credit by
clamping to min_vruntime. EEVDF keeps *lag* (how far a user is behind the weighted average) across
idle periods and separates "who is owed service" (eligibility) from "who goes first" (deadline).

Units: service is GPU-seconds (compute fraction x wall seconds). Virtual runtime `v` grows by
`service * 100 / weight`, so a weight-100 user's `v` is just their GPU-seconds. `V` is the
weight-averaged `v` of *active* users (work queued or running). Lag in service units is
`weight * (V - v) / 100`: positive means "owed", negative means "above share".

GPU jobs run for hours, so a start commits much more service than a CPU slice does, and charging
only as time passes makes whoever just finished look most owed: weights would act only on jobs
longer than the accounting horizon. So a start *commits* the job's expected service at once (the
scheduler calls `charge` with a virtual amount: fraction x min(estimate, commit_max_s)), the
running job is charged only what it uses beyond that, and when it ends or is preempted the charge
is reconciled with what it really used (a refund when it ended early). `v` is therefore "service
used or committed", eligibility is plain EEVDF (`v <= V`), and a user who just started eight jobs
stops being eligible in the same pass. Weights hold at every job length (docs/scheduling.md).

Pure: no clocks; callers pass service amounts and decide when to charge.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

WEIGHT_MIN = 1
WEIGHT_MAX = 10000
NICE0_WEIGHT = 100  # cgroup cpu.weight default, = CFS NICE_0_LOAD 1024

JobClassName = Literal["batch", "interactive"]


@dataclass(frozen=True, slots=True)
class FairnessConfig:
    """Fairness knobs as plain data; the daemon builds this from `[fairness]` in its TOML.

    `weights` and `groups` are keyed by user name or by the numeric uid as a string ("12345");
    the name wins when both are present. A user in a group shares the group's weight with the
    group's other active members in proportion to their own weights (cgroup-style).
    """

    default_weight: int = NICE0_WEIGHT
    weights: Mapping[str, int] = field(default_factory=dict)
    groups: Mapping[str, str] = field(default_factory=dict)  # user or uid -> group name
    group_weights: Mapping[str, int] = field(default_factory=dict)  # group -> weight (default_weight)
    batch_quantum_s: float = 3600.0  # request length a batch job's deadline is computed with
    interactive_quantum_s: float = 300.0  # shorter request => earlier deadline, same share
    lag_limit_gpu_s: float = 8 * 3600.0  # |lag| kept across idle periods, GPU-seconds at weight 100
    commit_max_s: float = 3600.0  # most of a job's expected run time charged when it starts

    def __post_init__(self) -> None:
        for name, w in [("default_weight", self.default_weight), *self.weights.items(),
                        *self.group_weights.items()]:
            if not WEIGHT_MIN <= w <= WEIGHT_MAX:
                raise ValueError(f"weight for {name!r} must be in {WEIGHT_MIN}..{WEIGHT_MAX}, got {w}")
        if self.batch_quantum_s <= 0 or self.interactive_quantum_s <= 0:
            raise ValueError("quanta must be positive")
        if self.lag_limit_gpu_s < 0:
            raise ValueError("lag_limit_gpu_s must be >= 0")
        if self.commit_max_s < 0:
            raise ValueError("commit_max_s must be >= 0")

    def quantum(self, job_class: str) -> float:
        """Request length (seconds) used for the virtual deadline of a job of this class."""
        return self.interactive_quantum_s if job_class == "interactive" else self.batch_quantum_s


@dataclass(slots=True)
class _User:
    """Mutable accounting for one user. `weight` is the effective weight (group split applied)."""

    name: str
    uid: int | None
    base_weight: int
    group: str | None
    weight: float
    v: float = 0.0
    vlag: float = 0.0  # saved V - v while idle (clamped); 0 for a new user
    service: float = 0.0  # GPU-seconds really used, ever (commitments are not service)
    outstanding: float = 0.0  # GPU-seconds committed by running jobs and not used yet
    active: bool = False


class FairShare:
    """Virtual runtimes, the weighted average V, lag and eligibility for all users.

    Sums over active users are kept incrementally (O(1) per charge, join or leave) and rebuilt
    every `_REBUILD_EVERY` updates so float drift cannot accumulate over months of replay.
    """

    _REBUILD_EVERY = 50_000

    def __init__(self, config: FairnessConfig | None = None) -> None:
        self.config = config or FairnessConfig()
        self._users: dict[str, _User] = {}
        self._sum_w = 0.0  # Σ w over active users
        self._sum_wv = 0.0  # Σ w·v over active users
        self._sum_out = 0.0  # Σ outstanding commitments of active users (GPU-s)
        self._v_idle = 0.0  # V when the active set last went empty: where the next joiner lands
        self._updates = 0
        self._group_active_w: dict[str, float] = {}  # group -> Σ base weight of active members

    # ---- weights -------------------------------------------------------------------------
    def base_weight(self, user: str, uid: int | None = None) -> int:
        """The configured weight of a user: by name, then by uid string, then the default."""
        w = self.config.weights.get(user)
        if w is None and uid is not None:
            w = self.config.weights.get(str(uid))
        return self.config.default_weight if w is None else w

    def _group_of(self, user: str, uid: int | None) -> str | None:
        g = self.config.groups.get(user)
        if g is None and uid is not None:
            g = self.config.groups.get(str(uid))
        return g

    def _user(self, user: str, uid: int | None = None) -> _User:
        u = self._users.get(user)
        if u is None:
            bw = self.base_weight(user, uid)
            u = _User(user, uid, bw, self._group_of(user, uid), float(bw), v=self._V_for_new())
            self._users[user] = u
        elif u.uid is None and uid is not None:
            u.uid = uid
            u.base_weight = self.base_weight(user, uid)
            u.group = self._group_of(user, uid)
        return u

    def _V_for_new(self) -> float:
        return self.V() if self._sum_w > 0 else self._v_idle

    def weight_alone(self, user: str, uid: int | None = None) -> float:
        """The weight a user would have as the only active one of their group: the group's weight
        for a member, else their own configured weight."""
        group = self._group_of(user, uid)
        if group is not None:
            return float(self.config.group_weights.get(group, self.config.default_weight))
        return float(self.base_weight(user, uid))

    def weight(self, user: str) -> float:
        """Effective weight now (group share applied)."""
        u = self._users.get(user)
        return u.weight if u is not None else float(self.config.default_weight)

    # ---- virtual time --------------------------------------------------------------------
    def V(self) -> float:
        """Weight-averaged virtual runtime of active users (the 'zero-lag' point)."""
        return self._sum_wv / self._sum_w if self._sum_w > 0 else self._v_idle

    def V_settled(self) -> float:
        """V as if every running job's unused commitment were refunded now: where joiners land.

        Joining at plain V would place a newcomer level with the commitments of users whose jobs
        just started; when those jobs end early and are refunded, the newcomer would be left behind
        as if they had received service they never got.
        """
        if self._sum_w <= 0:
            return self._v_idle
        return (self._sum_wv - self._sum_out * NICE0_WEIGHT) / self._sum_w

    def set_outstanding(self, user: str, service_gpu_s: float) -> None:
        """The GPU-seconds the user's running jobs have committed and not used yet (scheduler's view)."""
        u = self._user(user)
        value = max(0.0, service_gpu_s)
        if u.active:
            self._sum_out += value - u.outstanding
        u.outstanding = value

    def total_weight(self) -> float:
        """Σ effective weight of active users (0 when nobody is active)."""
        return self._sum_w

    def v(self, user: str) -> float:
        return self._users[user].v

    def lag(self, user: str) -> float:
        """Service (GPU-seconds) the user is owed (>0) or has taken above share (<0)."""
        u = self._users.get(user)
        if u is None:
            return 0.0
        vlag = (self.V() - u.v) if u.active else u.vlag
        return vlag * u.weight / NICE0_WEIGHT

    def is_eligible(self, user: str) -> bool:
        """EEVDF eligibility: v <= V (lag >= 0). v includes what running jobs have committed."""
        u = self._users.get(user)
        if u is None or not u.active:
            return True  # a joiner lands at lag 0
        return u.v <= self.V() + 1e-9

    def eligibility(self) -> Callable[[str], bool]:
        """`is_eligible` with V read once: a pick asks it of user after user while nothing changes."""
        bound = self.V() + 1e-9
        users = self._users

        def eligible(user: str) -> bool:
            u = users.get(user)
            return u is None or not u.active or u.v <= bound

        return eligible

    def deadline(self, user: str, fraction: float, request_s: float) -> float:
        """Virtual deadline of the user's next request: v + fraction·request_s·100/w.

        `request_s` is the job's expected length capped by its class quantum (`request_length`), so
        short and interactive jobs go earlier without a larger share: EEVDF's request size.
        """
        u = self._users[user]
        return u.v + fraction * request_s * NICE0_WEIGHT / u.weight

    def request_length(self, expected_s: float, job_class: str) -> float:
        """The request size behind a deadline: the expected run time, at most the class quantum."""
        return min(expected_s, self.config.quantum(job_class))

    def commitment(self, fraction: float, expected_s: float) -> float:
        """Service (GPU-s) a start commits at once: fraction x min(expected run time, commit_max_s)."""
        return fraction * min(max(expected_s, 0.0), self.config.commit_max_s)

    def is_active(self, user: str) -> bool:
        u = self._users.get(user)
        return u is not None and u.active

    def service(self, user: str) -> float:
        u = self._users.get(user)
        return u.service if u is not None else 0.0

    def users(self) -> list[str]:
        return list(self._users)

    def active_users(self) -> list[str]:
        return [name for name, u in self._users.items() if u.active]

    # ---- membership ----------------------------------------------------------------------
    def _lag_limit_v(self, weight: float) -> float:
        return self.config.lag_limit_gpu_s * NICE0_WEIGHT / weight

    def activate(self, user: str, uid: int | None = None) -> None:
        """The user has work queued or running again: place them at their saved (clamped) lag.

        v = V - vlag·(W + w)/W; the inflation makes the lag *after* joining equal the saved lag,
        because joining moves V (kernel place_entity, PLACE_LAG).
        """
        u = self._user(user, uid)
        if u.active:
            return
        self._bump()
        if u.group is not None:
            self._regroup(u.group, u, joining=True)
        w = u.weight
        if self._sum_w > 0:
            u.v = self.V_settled() - u.vlag * (self._sum_w + w) / self._sum_w
        else:
            u.v = self._v_idle - u.vlag
        u.v += u.outstanding * NICE0_WEIGHT / w  # what their own running jobs still hold
        u.active = True
        self._sum_w += w
        self._sum_wv += w * u.v
        self._sum_out += u.outstanding

    def deactivate(self, user: str) -> None:
        """No more work queued or running: save the clamped lag so idling neither earns nor erases."""
        u = self._users.get(user)
        if u is None or not u.active:
            return
        self._bump()
        limit = self._lag_limit_v(u.weight)
        settled_v = u.v - u.outstanding * NICE0_WEIGHT / u.weight
        u.vlag = max(-limit, min(limit, self.V_settled() - settled_v))
        self._sum_w -= u.weight
        self._sum_wv -= u.weight * u.v
        self._sum_out -= u.outstanding
        u.active = False
        if self._sum_w <= 1e-12:
            self._v_idle = settled_v + u.vlag  # = settled V just before the last active user left
            self._sum_w = self._sum_wv = self._sum_out = 0.0
        if u.group is not None:
            self._regroup(u.group, u, joining=False)

    def _regroup(self, group: str, who: _User, *, joining: bool) -> None:
        """Split the group's weight among its active members in proportion to their own weights.

        Members' v is kept as is on reweight (an approximation of kernel reweight_entity); the error
        is bounded by one horizon of service and disappears in the long-run shares.
        """
        total = self._group_active_w.get(group, 0.0) + (who.base_weight if joining else -who.base_weight)
        self._group_active_w[group] = max(total, 0.0)
        gw = self.config.group_weights.get(group, self.config.default_weight)
        members = [m for m in self._users.values() if m.group == group and (m.active or m is who)]
        for m in members:
            new_w = gw * m.base_weight / total if total > 0 else float(m.base_weight)
            if m.active:
                self._sum_w += new_w - m.weight
                self._sum_wv += (new_w - m.weight) * m.v
            m.weight = max(new_w, 1e-6)

    def charge(self, user: str, service_gpu_s: float, *, virtual_gpu_s: float | None = None) -> None:
        """Account `service_gpu_s` GPU-seconds really used, and move v by `virtual_gpu_s` of them
        (default: the same). A start passes service 0 and its commitment as the virtual part; the
        reconciliation at the end passes a negative virtual part when the job used less."""
        virtual = service_gpu_s if virtual_gpu_s is None else virtual_gpu_s
        if service_gpu_s <= 0 and virtual == 0:
            return
        u = self._user(user)
        u.service += max(0.0, service_gpu_s)
        dv = virtual * NICE0_WEIGHT / u.weight
        u.v += dv
        if u.active:
            self._sum_wv += u.weight * dv
        else:
            # Charged while idle (a job ended between passes): debt or refund all the same, clamped.
            limit = self._lag_limit_v(u.weight)
            u.vlag = max(-limit, min(limit, u.vlag - dv))
        self._bump()

    def _bump(self) -> None:
        self._updates += 1
        if self._updates >= self._REBUILD_EVERY:
            self._updates = 0
            act = [u for u in self._users.values() if u.active]
            self._sum_w = sum(u.weight for u in act)
            self._sum_wv = sum(u.weight * u.v for u in act)
            self._sum_out = sum(u.outstanding for u in act)

    # ---- persistence ---------------------------------------------------------------------
    def export_standing(self) -> dict[str, dict[str, float]]:
        """Plain data the daemon persists: per user the lag (GPU-s, clamped), v and total service.

        Absolute v only matters relative to V, so `lag` is what `load_standing` restores. Running
        jobs' unused commitments are settled in what is exported, as if those jobs ended now: after
        a restart the scheduler adopts them afresh and charges only what they use from then on.
        """
        back = {name: u.outstanding * NICE0_WEIGHT / u.weight for name, u in self._users.items() if u.outstanding > 0}
        V = self.V_settled()
        out: dict[str, dict[str, float]] = {}
        for name, u in self._users.items():
            v = u.v - back.get(name, 0.0)
            vlag = (V - v) if u.active else u.vlag + back.get(name, 0.0)
            limit = self._lag_limit_v(u.weight)
            vlag = max(-limit, min(limit, vlag))
            out[name] = {
                "lag": vlag * u.weight / NICE0_WEIGHT,
                "v": v,
                "service": u.service,
                "uid": float(u.uid) if u.uid is not None else -1.0,
            }
        return out

    def load_standing(self, standing: Mapping[str, Mapping[str, float]]) -> None:
        """Restore users as idle with their saved lag; they rejoin at that lag when work appears."""
        for name, row in standing.items():
            uid_f = row.get("uid", -1.0)
            uid = int(uid_f) if uid_f >= 0 else None
            if name in self._users and self._users[name].active:
                self.deactivate(name)
            u = self._user(name, uid)
            u.service = float(row.get("service", 0.0))
            u.v = float(row.get("v", 0.0))
            limit = self._lag_limit_v(u.weight)
            u.vlag = max(-limit, min(limit, float(row.get("lag", 0.0)) * NICE0_WEIGHT / u.weight))
