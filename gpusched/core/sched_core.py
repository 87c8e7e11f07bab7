"""The scheduler's state, its configuration, and the primitives every part of it uses: placement
with the pass's exclusions, charging, expected ends, and the words for why a job waits.

scheduler.py composes the parts (sched_sync, sched_mig, sched_preempt, sched_explain) with the pass.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from gpusched.core.actions import FailJob
from gpusched.core.estimate import EstimatorConfig, RuntimeEstimator
from gpusched.core.fairshare import FairnessConfig, FairShare
from gpusched.core.interactive import InteractiveDemand
from gpusched.core.migplan import MigPolicy
from gpusched.core.placement import Cluster
from gpusched.core.placement import unsatisfiable_reason as _unsatisfiable_reason
from gpusched.core.preempt import LossBudget
from gpusched.core.queue import RunQueue
from gpusched.gpu.backend import Gpu
from gpusched.model import (
    Allocation,
    Job,
    MigRequest,
    PartitionRequest,
    ShareRequest,
    WholeRequest,
)


def unsatisfiable_reason(
    request: WholeRequest | MigRequest | ShareRequest | PartitionRequest,
    gpus: Sequence[Gpu],
    share_modes: Mapping[str, str] | None = None,
    dynamic: frozenset[int] = frozenset(),
    mode_toggle: bool = False,
) -> str | None:
    """Why this node can never run the request, in words that say what the node has; None if it can.

    Knows share modes (a share needs an mps/timeslice device with enough memory) and dynamic MIG
    GPUs (a profile their model offers can be created on demand; with `mode_toggle` they can also
    leave MIG mode for whole-GPU work). See placement.unsatisfiable_reason.
    """
    return _unsatisfiable_reason(request, gpus, share_modes, dynamic, mode_toggle)


Candidate = tuple[Job, tuple[object, ...]]  # a pending job and its _signature
# What the blocked head's reservation is worked out from, kept until first read (sched_reserve.py):
# the placement view, the head, now, the reserved devices, the view's fingerprint, MIG claims.
ReserveArgs = tuple[Cluster, Job, float, frozenset[str], tuple[object, ...], frozenset[str]]
ScanEntry = tuple[int, list[Candidate], frozenset[int], list[Candidate]]


@dataclass(frozen=True, slots=True)
class Wording:
    """Why a job waits, put into words only when someone asks (`gpusched show`): a pass records a
    reason for every job it looks at, pass after pass, and almost none is ever read."""

    template: str
    args: tuple[object, ...]

    def __str__(self) -> str:
        return self.template.format(*self.args)


@dataclass(frozen=True, slots=True)
class FailMemo:
    """The signatures that found no room by the end of a pass, and what they were asked under.

    The next pass takes them as failed when the view is the same (fingerprint, head), or, on the
    same view object, all but those that fit on a device freed since `mark` (sched_scan.py)."""

    fingerprint: tuple[object, ...]
    reserved: frozenset[str]
    doomed: frozenset[str]
    head_id: int
    fails: frozenset[object]
    cluster: Cluster
    mark: int  # cluster.free_mark() then


# user -> (queue version, signatures tried, MIG profiles they asked for) in a pass (sched_scan.py)
# ... and the head job left out of their candidates then (None: none of theirs was)
UserMemo = dict[str, tuple[int, frozenset[object], tuple[str, ...], int | None]]


@dataclass(frozen=True, slots=True)
class Shapes:
    """One user's backfill candidates read once: what most passes need of them is that all fail."""

    firsts: tuple[Candidate, ...]  # the first job of each signature, in order
    sigs: frozenset[object]
    mig_profiles: tuple[str, ...]  # the profile of each MIG candidate, in order (creation demand)
    blocked: dict[int, None]  # every candidate's id, for _blocked (did not fit)

    @classmethod
    def of(cls, cands: list[Candidate]) -> Shapes:
        firsts: dict[object, Candidate] = {}
        for cand in cands:
            firsts.setdefault(cand[1], cand)
        return cls(tuple(firsts.values()), frozenset(firsts),
                   tuple(str(sig[1]) for _, sig in cands if sig[0] == "m"),
                   dict.fromkeys(job.id for job, _ in cands))



@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Policy knobs as plain data; the daemon builds this from its TOML (`[fairness]`, `[scheduler]`, `[mig]`)."""

    fairness: FairnessConfig = field(default_factory=FairnessConfig)
    mig: MigPolicy = field(default_factory=MigPolicy)
    estimator: EstimatorConfig = field(default_factory=EstimatorConfig)
    preempt_after_s: float | None = 1800.0  # None: never preempt
    preempt_min_gain_s: float = 300.0  # preempt only if the job would otherwise wait longer than this
    preempt_min_run_s: float = 600.0  # a job runs at least this long before it may be preempted
    preempt_lag_margin_gpu_s: float = 900.0  # victims' owners must be this far above share (GPU-s)
    preempt_max_per_job: int = 0  # a job is preempted at most this often (0: no cap; the loss budget bounds it)
    preempt_budget_gpu_s: float = 4 * 3600.0  # work a user may lose to requeue preemption per day (GPU-s)
    preempt_suspend_shares: bool = True  # a share may be preempted by suspending it in place (SIGSTOP)
    interactive_window_s: float = 3600.0  # interactive demand this recent keeps headroom (core/interactive.py)
    interactive_headroom_gpus: int = 1  # most devices kept for interactive work (0: none)
    # ... and at most this fraction of the node's GPUs (rounded down): on a 2- or 3-GPU node a kept
    # GPU would block every 2-GPU batch job for as long as the window lasts.
    interactive_headroom_fraction: float = 0.25
    interactive_preempt_after_s: float | None = 0.0  # an interactive job waiting this long may preempt
    # Whose shares may join an MPS device where another user's server runs (each user has their own
    # server there; servers time-slice): interactive jobs only, by default, because for them starting
    # now at part speed beats waiting; batch jobs keep devices of their own.
    mps_across_users: Literal["never", "interactive", "always"] = "interactive"
    backfill: bool = True
    backfill_unknown_horizon_s: float = 3600.0  # max time limit to backfill when the head's start is unknown
    # The head's reservation holds back jobs that would use its devices (and cannot prove they end in
    # time) only once the head has waited this long; 0 = at once (conservative). A positive value
    # trades a bounded extra wait for the head against keeping GPUs busy when nothing has a limit.
    reserve_after_s: float = 0.0
    # A blocked fairness head that has waited this long keeps its place (and its reservation) until it
    # starts, even if another user becomes more owed meanwhile. None: never (the default: measured on
    # the Alibaba traces, holding heads made mean JCT 1.5-3x worse and Jain lower; docs/scheduling.md).
    hold_head_after_s: float | None = None
    max_scan: int = 2000  # pending jobs examined per pass once the fairness head is blocked
    per_user_scan: int = 8  # jobs of one user examined for backfill per pass
    max_mig_demand: int = 16  # blocked MIG jobs turned into creation demand per pass


@dataclass(slots=True)
class _Active:
    """A job holding devices: whom to charge, at what rate, since when, and what it committed.

    `committed` is the virtual service charged when it started (fairshare's commitment); `used` is
    the service it has really used. v moves by `committed` at the start and by whatever `used`
    exceeds it while it runs; the end settles the difference (fairshare.py, "commits").
    """

    user: str
    uid: int
    fraction: float
    last_charge: float
    running: bool
    requeue: bool
    started: float
    job: Job
    alloc: Allocation
    predicted: float  # expected run time when it started
    committed: float = 0.0
    used: float = 0.0


@dataclass(slots=True)
class _Reservation:
    """The fairness head's claim on the future, which backfill must not break."""

    job_id: int
    at: float  # when the head is expected to fit; inf: only after jobs without a time limit end
    uuids: frozenset[str]  # devices it is expected to get then; nobody else may take them
    served_by_ends: bool = True  # False: no running job's end helps (it waits for MIG changes)


class SchedulerCore:
    """The scheduler's state and the primitives its parts share."""

    # Set by Scheduler.__init__ (scheduler.py); declared here so every part is typed alike.
    config: SchedulerConfig
    fair: FairShare
    estimator: RuntimeEstimator
    queue: RunQueue
    incremental: bool
    _active: dict[int, _Active]
    _unused: dict[str, float]
    _running_jobs: dict[str, int]
    _failed: dict[int, str]
    _to_fail: list[FailJob]
    _fail_cache: dict[object, str | None]
    _last_unsat: tuple[object, object, str | None]
    _shape: object
    _shape_seen: tuple[object, ...]
    _gpus: tuple[Gpu, ...]
    _share_modes: Mapping[str, str]
    _dynamic: frozenset[int]
    _idle_since: dict[str, float]
    _last_reconfig: dict[int, float]
    _gpu_idle_since: dict[int, float]
    _part_idle_since: dict[int, float]  # AMD physical GPU -> since when no job has run on it
    _part_last_reconfig: dict[int, float]  # AMD physical GPU -> when its partition mode last changed
    _preempting: dict[int, float]
    _started_at_first_plan: float | None
    _charged_until: float | None
    _blocked: dict[int, str | Wording | None]
    _reservation: _Reservation | None
    _reserve_args: ReserveArgs | None
    _last_now: float
    _last_pending: tuple[Job, ...] | None
    _pending_since: dict[int, float]
    _times_preempted: dict[int, int]
    _head_id: int | None
    _cluster: Cluster | None
    _live: Cluster | None
    _live_gpus: tuple[Gpu, ...] | None
    _live_shape: tuple[object, ...]
    _reserve_memo: tuple[object, tuple[int | None, frozenset[str]]] | None  # key -> (release index, devices)
    # user -> (queue version, first per_user_scan jobs, ids of the first per_user_scan + 1, those jobs)
    _scan: dict[str, ScanEntry]
    _shapes: dict[str, tuple[list[Candidate], Shapes]]  # a user's candidates and what backfill reads of them
    _demand: InteractiveDemand
    _interactive_pending: dict[int, float]
    _headroom: frozenset[str]
    _reserved: frozenset[str]
    _budget: LossBudget
    _pinned: dict[int, frozenset[str]]
    _no_checkpoint: set[int]
    _yielded_for: dict[int, int]
    _no_victims: object
    _fail_memo: FailMemo | None
    # this pass: the last pass's failures and the devices freed since (sched_scan._still_failing)
    _refit: tuple[frozenset[object], frozenset[str]] | None
    _user_memo: UserMemo

    def _unsat(self, job: Job) -> str | None:
        req = job.spec.request
        # A request is a frozen model, hashed field by field in Python on every lookup; a sweep's jobs
        # share one request object (daemon/compact.py), so the last answer is kept by identity first
        # (for this very table: a new node shape starts a new one).
        cache = self._fail_cache
        last = self._last_unsat
        if last[1] is req and last[0] is cache:
            return last[2]
        if req in cache:
            reason = cache[req]
        else:
            reason = cache[req] = unsatisfiable_reason(req, self._gpus, self._share_modes, self._dynamic,
                                                       self.config.mig.toggle_mode)
        self._last_unsat = (cache, req, reason)
        return reason

    def _place(self, cluster: Cluster, job: Job, reserved: frozenset[str],
               claimed: frozenset[str] = frozenset(), only: Collection[str] | None = None) -> Allocation | None:
        """Place with the pass's exclusions: interactive-only devices, instances the head claimed.

        `only` narrows the devices like `reserved` does (everything else counts as reserved), so an
        interactive job, which may use reserved devices, ignores it too."""
        forbidden = self._forbidden(cluster, job, reserved, claimed)
        interactive = job.spec.job_class == "interactive"
        across = self.config.mps_across_users
        any_uid = across == "always" or (across == "interactive" and interactive)
        return cluster.place(job, forbidden=forbidden, mps_any_uid=any_uid, only=None if interactive else only)

    def _forbidden(self, cluster: Cluster, job: Job, reserved: frozenset[str],
                   claimed: frozenset[str] = frozenset()) -> frozenset[str]:
        """The devices `_place` keeps the job off."""
        # (a union only when there is something to add: the same set object keeps its hash cached,
        # and placements are memoised by it)
        forbidden = claimed if job.spec.job_class == "interactive" else (reserved | claimed if claimed else reserved)
        pinned = self._pinned.get(job.id)
        if pinned is not None:  # a checkpointed job resumes on the devices that hold its state
            forbidden = forbidden | (frozenset(cluster.devices) - pinned)
        return forbidden

    def _candidates(self, user: str, version: int, head_id: int) -> list[Candidate]:
        """The user's first `per_user_scan` pending jobs other than the head, with their signatures.

        Backfill looks at the same few jobs of each user pass after pass: they are listed again only
        when the user's queue changed (its version), not walked and re-signed every pass.
        """
        cached = self._scan.get(user)
        if cached is None or cached[0] != version:
            n = self.config.per_user_scan
            first = [(job, _signature(job)) for job in itertools.islice(self.queue.jobs_of(user), n + 1)]
            cached = self._scan[user] = (version, first[:n], frozenset(job.id for job, _ in first), first)
        if head_id not in cached[2]:
            return cached[1]
        return [c for c in cached[3] if c[0].id != head_id][: self.config.per_user_scan]

    def _expected_end(self, rec: _Active, now: float) -> float:
        """When a running job is expected to end: never before k x its elapsed time (estimate.py)."""
        return rec.started + self.estimator.expected_total(rec.job, rec.predicted, now - rec.started)

    def _count_running(self, rec: _Active, sign: int) -> None:
        """Jobs holding devices per user: a user with one is active in FairShare even with none queued."""
        self._running_jobs[rec.user] = self._running_jobs.get(rec.user, 0) + sign
        if self._running_jobs[rec.user] <= 0:
            del self._running_jobs[rec.user]
        if sign > 0 and not self.fair.is_active(rec.user):
            self.fair.activate(rec.user, rec.uid)

    def _sync_user(self, user: str) -> None:
        """Keep FairShare's active set = users with work queued or running, and re-key the user."""
        if self.queue.has_user(user):
            self.queue.rekey(user)
            return
        self._scan.pop(user, None)
        if self._running_jobs.get(user, 0) <= 0:
            self.fair.deactivate(user)

    def _outstanding(self, user: str, delta: float) -> None:
        """Keep FairShare's view of each user's unused commitments (where joiners land) current."""
        value = self._unused.get(user, 0.0) + delta
        if value > 1e-9:
            self._unused[user] = value
        else:
            self._unused.pop(user, None)
            value = 0.0
        self.fair.set_outstanding(user, value)

    def _accrue(self, rec: _Active, service: float) -> bool:
        """Charge used service; v moves only by what goes beyond the start's commitment. True if it moved."""
        over_before = max(0.0, rec.used - rec.committed)
        within = min(service, max(0.0, rec.committed - rec.used))
        rec.used += service
        virtual = max(0.0, rec.used - rec.committed) - over_before
        self.fair.charge(rec.user, service, virtual_gpu_s=virtual)
        if within > 0:
            self._outstanding(rec.user, -within)
        return virtual != 0

    def _fair_reason(self, job: Job) -> str:
        lag_h = self.fair.lag(job.user) / 3600
        elig = "eligible" if self.fair.is_eligible(job.user) else "no eligible user waiting"
        return f"fair share: {job.user} {elig}, earliest deadline (lag {lag_h:+.2f} GPU-h)"

    def _need(self, job: Job, cluster: Cluster) -> str:
        req = job.spec.request
        if isinstance(req, WholeRequest):
            kept = sum(1 for u in self._reserved if (d := cluster.devices.get(u)) is not None
                       and d.kind == "gpu" and d.idle) if job.spec.job_class != "interactive" else 0
            note = f", {kept} of them kept for interactive work" if kept else ""
            return f"waiting for {req.gpus} whole GPU(s) ({cluster.idle_whole()} idle now{note})"
        if isinstance(req, MigRequest):
            return f"waiting for a free {req.profile}"
        if isinstance(req, PartitionRequest):
            return (f"waiting for {req.gpus} idle logical GPU(s) in {req.mode} mode (idle GPUs change mode "
                    "from demand after [mig] min_idle_s)")
        return f"waiting for a share of {req.fraction:g} with {req.gpu_mem_mib} MiB on an mps/timeslice device"


def _signature(job: Job) -> tuple[object, ...]:
    """What decides whether a job fits: its request (and uid for shares: MPS serves one uid) and class.

    Plain tuples: hashing the pydantic request models dominated the pass on long queues.
    """
    req = job.spec.request
    if isinstance(req, WholeRequest):
        return ("g", req.gpus, job.spec.job_class)
    if isinstance(req, MigRequest):
        return ("m", req.profile, job.spec.job_class)
    if isinstance(req, PartitionRequest):
        return ("p", req.mode, req.gpus, job.spec.job_class)
    return ("s", req.fraction, req.gpu_mem_mib, job.uid, job.spec.job_class)
