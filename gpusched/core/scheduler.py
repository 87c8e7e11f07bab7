"""The only place scheduling decisions are made: `Scheduler.plan(snapshot, now) -> [Action]`.

Pure: the snapshot carries everything (GPUs, jobs, share modes, what is drained), `now` is passed
in, and the result is a list of actions for the engine to carry out. The same object runs in the
daemon and in trace replay, so everything here is deterministic for a given sequence of calls.

`Scheduler` keeps state between passes (fair-share standing, the run queue, charge times, MIG idle
timers) and updates it from what changed, so a pass costs about O(changed + active + started),
not O(pending). `FifoScheduler` is the v1 first-come-first-served policy, kept for comparisons.

Contract with the engine (docs/scheduling.md): apply the actions of one plan (destroys before
creates, in list order) and commit their results before calling plan again; a job whose StartJob
failed goes back to PENDING and simply reappears in `snapshot.pending`.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from gpusched.core.actions import (
    Action,
    CreateInstance,
    DestroyInstance,
    FailJob,
    PreemptJob,
    ResumeJob,
    SetMigMode,
    Snapshot,
    StartJob,
    busy_uuids,
)
from gpusched.core.estimate import Estimate, EstimatorConfig, RuntimeEstimator
from gpusched.core.fairshare import FairnessConfig, FairShare
from gpusched.core.fifo import FifoScheduler, schedulable_devices
from gpusched.core.interactive import InteractiveDemand, choose_headroom
from gpusched.core.migplan import MigPolicy, plan_dynamic
from gpusched.core.placement import Cluster
from gpusched.core.placement import unsatisfiable_reason as _unsatisfiable_reason
from gpusched.core.preempt import Candidate, LossBudget, choose_victims
from gpusched.core.queue import RunQueue, request_fraction
from gpusched.gpu.backend import Gpu
from gpusched.model import (
    ACTIVE_STATES,
    Allocation,
    Job,
    JobState,
    MigRequest,
    ShareRequest,
    WholeRequest,
    describe_request,
)

__all__ = [
    "Action",
    "CreateInstance",
    "DestroyInstance",
    "FailJob",
    "FifoScheduler",
    "PreemptJob",
    "ResumeJob",
    "Scheduler",
    "SchedulerConfig",
    "SetMigMode",
    "Snapshot",
    "StartJob",
    "busy_uuids",
    "schedulable_devices",
    "unsatisfiable_reason",
]


def unsatisfiable_reason(
    request: WholeRequest | MigRequest | ShareRequest,
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


class Scheduler:
    """Fair share (EEVDF over users) + placement + dynamic MIG + backfill + preemption.

    The daemon calls, in this order of life:
      1. `Scheduler(SchedulerConfig(...))`, then `load_standing(saved)` if it has saved standing;
      2. `plan(snapshot, now)` on every event (submit, exit, cancel, tick); apply the actions;
      3. `export_standing()` whenever it persists (e.g. after each plan that started or ended jobs);
      4. `explain(job_id)` / `fairness_order()` for `gpusched show` / `gpusched queue`.
    With `incremental=True` the daemon instead reports pending changes via `submit(job)` and
    `remove(job_id)` and `plan` ignores `snapshot.pending`; otherwise plan diffs snapshot.pending
    against what it holds (an O(pending) set difference, about 10 ms at 100k jobs).
    """

    def __init__(self, config: SchedulerConfig | None = None, *, incremental: bool = False) -> None:
        self.config = config or SchedulerConfig()
        self.fair = FairShare(self.config.fairness)
        self.estimator = RuntimeEstimator(self.config.estimator)
        self.queue = RunQueue(self.fair, expected=self.estimator.predict)
        self.incremental = incremental
        self._active: dict[int, _Active] = {}
        self._unused: dict[str, float] = {}  # user -> GPU-s committed by running jobs, not used yet
        self._running_jobs: dict[str, int] = {}
        self._failed: dict[int, str] = {}  # failed job id -> reason (until it leaves pending)
        self._to_fail: list[FailJob] = []
        self._fail_cache: dict[object, str | None] = {}
        self._shape: object = None
        self._shape_seen: tuple[object, ...] = (None, None, None)
        self._gpus: tuple[Gpu, ...] = ()
        self._share_modes: Mapping[str, str] = {}
        self._dynamic: frozenset[int] = frozenset()
        self._idle_since: dict[str, float] = {}
        self._last_reconfig: dict[int, float] = {}
        self._gpu_idle_since: dict[int, float] = {}  # dynamic GPU -> since when nothing has run on it
        self._preempting: dict[int, float] = {}
        self._started_at_first_plan: float | None = None
        # pending job id -> why it did not start in the last pass; None: it did not fit, and what it
        # needs is worded only when someone asks (against the pass's final placement state)
        self._blocked: dict[int, str | None] = {}
        self._reservation: _Reservation | None = None
        self._last_now = 0.0
        self._last_pending: tuple[Job, ...] | None = None  # identity fast path for an unchanged tuple
        self._pending_since: dict[int, float] = {}  # when a job (last) became pending, for waits
        self._times_preempted: dict[int, int] = {}
        # The job that was next by fairness and blocked: it stays first until it starts, so a big job
        # cannot lose its reservation to whoever is most owed a moment later (it would starve).
        self._head_id: int | None = None
        self._cluster: Cluster | None = None
        self._reserve_memo: tuple[object, _Reservation] | None = None
        self._sigs: dict[int, tuple[object, ...]] = {}  # pending job -> _signature (passes ask many times)
        self._demand = InteractiveDemand(self.config.interactive_window_s)
        self._interactive_pending: dict[int, float] = {}  # pending interactive job -> GPUs' worth
        self._headroom: frozenset[str] = frozenset()
        self._budget = LossBudget(self.config.preempt_budget_gpu_s)
        self._pinned: dict[int, frozenset[str]] = {}  # checkpointed job -> the devices it resumes on
        self._no_checkpoint: set[int] = set()  # running jobs the engine could not checkpoint
        self._yielded_for: dict[int, int] = {}  # share suspended in place -> the job it stopped for
        self._no_victims: object = None  # the last victim search that found none (see _preempt)
        # Requests that found no room in the last pass, valid while the cluster is the same (see plan).
        self._fail_memo: tuple[object, frozenset[object]] = ((), frozenset())
        # user -> (queue version, signatures tried, MIG profiles they asked for) in the last pass
        self._user_memo: dict[str, tuple[int, frozenset[object], tuple[str, ...]]] = {}

    # ---- standing ------------------------------------------------------------------------
    def export_standing(self) -> dict[str, dict[str, float]]:
        """Per-user lag / v / service as plain data, for the store.

        Running jobs' unused commitments are settled in what is exported (fairshare.py).
        """
        return self.fair.export_standing()

    def export_history(self) -> dict[str, list[float]]:
        """Recent run times by key (core/estimate.py), for the store."""
        return self.estimator.export_history()

    def load_history(self, saved: Mapping[str, Sequence[float]]) -> None:
        """Restore what export_history gave; call before the first plan."""
        self.estimator.load_history(saved)

    def observe_end(self, job: Job) -> None:
        """A job ended for good: learn its run time if it ran to its own end (or its limit).

        Cancelled, lost and preempted runs say nothing about how long the job needs.
        """
        if (job.state in (JobState.COMPLETED, JobState.FAILED, JobState.TIMEOUT)
                and job.started_at is not None and job.ended_at is not None):
            self.estimator.observe(job, job.ended_at - job.started_at)

    def estimate(self, job: Job) -> Estimate:
        """The run-time estimate a job is (or would be) scheduled with, and where it came from."""
        return self.estimator.estimate(job)

    def load_standing(self, standing: Mapping[str, Mapping[str, float]]) -> None:
        """Restore what export_standing gave; call before the first plan."""
        self.fair.load_standing(standing)

    # ---- incremental pending -------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """A job became PENDING (submitted, released from HELD, requeued after preemption)."""
        if job.id in self._failed:
            return
        if self._shape is None:  # node not seen yet: the first plan checks every queued job
            self._pending_since.setdefault(job.id, job.submitted_at)
            self.queue.submit(job)
            if job.spec.job_class == "interactive":
                self._interactive_pending[job.id] = request_fraction(job.spec.request)
            return
        reason = self._unsat(job)
        if reason is not None:
            self._failed[job.id] = reason
            self._to_fail.append(FailJob(job.id, f"unsatisfiable: {reason}"))
            return
        self._pending_since.setdefault(job.id, max(job.submitted_at, self._last_now))
        self.queue.submit(job)
        if job.spec.job_class == "interactive":
            self._interactive_pending[job.id] = request_fraction(job.spec.request)

    def pin(self, job_id: int, uuids: Iterable[str]) -> None:
        """A checkpointed job (submitted like a pending one) resumes only on these devices: they hold
        its state. For jobs checkpointed before a restart; a preemption in this scheduler pins itself."""
        self._pinned[job_id] = frozenset(uuids)

    def preempt_failed(self, job_id: int) -> None:
        """The engine could not carry out a checkpoint preemption: the job runs on where it was. It is
        not offered for checkpointing again (a requeue job may still be requeued)."""
        self._preempting.pop(job_id, None)
        self._pinned.pop(job_id, None)
        self._no_checkpoint.add(job_id)

    def remove(self, job_id: int) -> None:
        """A job left PENDING other than by our StartJob (cancelled, held, failed elsewhere)."""
        job = self.queue.remove(job_id)
        self._sigs.pop(job_id, None)
        self._interactive_pending.pop(job_id, None)
        self._pinned.pop(job_id, None)
        if self._head_id == job_id:
            self._head_id = None
        self._pending_since.pop(job_id, None)
        self._failed.pop(job_id, None)
        self._blocked.pop(job_id, None)
        if job is not None:
            self._sync_user(job.user)

    def _unsat(self, job: Job) -> str | None:
        req = job.spec.request
        if req not in self._fail_cache:
            self._fail_cache[req] = unsatisfiable_reason(req, self._gpus, self._share_modes, self._dynamic,
                                                         self.config.mig.toggle_mode)
        return self._fail_cache[req]

    # ---- the pass ------------------------------------------------------------------------
    def plan(self, snapshot: Snapshot, now: float) -> list[Action]:
        """Decide what to do now. See the class doc for when to call it."""
        if self._started_at_first_plan is None:
            self._started_at_first_plan = now
        self._last_now = now
        self._observe_shape(snapshot)
        if not self.incremental and snapshot.pending is not self._last_pending:
            self._sync_pending(snapshot.pending)
            self._last_pending = snapshot.pending
        self._sync_active(snapshot.active, now)
        actions: list[Action] = list(self._to_fail)
        self._to_fail = []
        self._track_idle(snapshot, now)

        cluster = Cluster.build(snapshot.gpus, snapshot.active, share_modes=snapshot.share_modes,
                                unschedulable=snapshot.unschedulable, mps_owner=snapshot.mps_owner,
                                yielded=snapshot.yielded)
        actions.extend(self._resume_yielded(cluster, snapshot.yielded))
        reserved = snapshot.reserved_interactive | self._plan_headroom(cluster, snapshot, now)
        self._reservation = None
        head: Job | None = None
        fails: set[object] = set()
        mig_demand: list[str] = []
        doomed: frozenset[str] = frozenset()  # idle instances the head's MIG reconfiguration needs
        remembered = False  # fails were carried over from the last pass (nothing freed since)
        user_memo: dict[str, tuple[int, frozenset[object], tuple[str, ...]]] = {}
        scanned = 0
        try:
            while scanned <= self.config.max_scan:
                held = self.queue.get(self._head_id) if head is None and self._head_id is not None else None
                user = held.user if held is not None else self.queue.pick()
                if user is None:
                    break
                if head is None:
                    job = held if held is not None else self.queue.head(user)
                    assert job is not None
                    alloc = self._place(cluster, job, reserved)
                    if alloc is not None:
                        why = self._fair_reason(job) if held is None else "next by fairness since it was reserved"
                        actions.append(self._start(cluster, job, alloc, now, why))
                        continue
                    head = job
                    hold = self.config.hold_head_after_s
                    if hold is not None and now - self._pending_since.get(job.id, now) >= hold:
                        self._head_id = job.id
                    if isinstance(job.spec.request, MigRequest):
                        mig_demand.append(job.spec.request.profile)
                    fingerprint = cluster.fingerprint()  # what is held while the head blocks
                    self._reservation = self._reserve(cluster, job, now, reserved, fingerprint)
                    doomed = self._mig_claim(snapshot, job)
                    if doomed:
                        self._reservation.uuids = self._reservation.uuids | doomed
                    self._blocked[job.id] = "next by fairness; " + self._need(job, cluster)
                    memo_key, memo_fails = self._fail_memo
                    if memo_fails and memo_key == (fingerprint, reserved, doomed, job.id):
                        fails |= memo_fails  # nothing was freed since they failed: they fail again
                        remembered = True
                        self._park_remembered(head, fails, user_memo, mig_demand)
                    if not self.config.backfill:
                        break
                    # The head's own user is not parked: their other jobs may backfill too (a MIG job
                    # behind their blocked whole-GPU job should not idle a free instance).
                    continue
                if not cluster.has_room():
                    break
                if remembered and self._park_if_remembered(user, fails, user_memo, mig_demand):
                    continue
                version = self.queue.version(user)
                started = False
                tried: set[object] = set()
                wanted: list[str] = []
                for k, job in enumerate(j for j in self.queue.jobs_of(user) if j.id != head.id):
                    if k >= self.config.per_user_scan:
                        break
                    scanned += 1
                    sig = self._sigs.get(job.id)
                    if sig is None:
                        sig = self._sigs[job.id] = _signature(job)
                    tried.add(sig)
                    alloc = None if sig in fails else self._place(cluster, job, reserved, doomed)
                    if alloc is None:
                        fails.add(sig)
                        if isinstance(job.spec.request, MigRequest):
                            wanted.append(job.spec.request.profile)
                            if len(mig_demand) < self.config.max_mig_demand:
                                mig_demand.append(job.spec.request.profile)
                        self._blocked[job.id] = None
                        continue
                    ok, why = self._backfill_ok(job, alloc, now)
                    if ok:
                        actions.append(self._start(cluster, job, alloc, now, why))
                        started = True
                        break
                    self._blocked[job.id] = why
                    tried.add(("backfill", job.id))  # a placement that fits is never a memo hit
                if not started:
                    user_memo[user] = (version, frozenset(tried), tuple(wanted))
                    self.queue.park(user)
        finally:
            self.queue.unpark_all()
        self._cluster = cluster  # what is held after this pass: `expected_start` plays forward from it
        self._fail_memo = (((cluster.fingerprint(), reserved, doomed, head.id), frozenset(fails))
                           if fails and head is not None else ((), frozenset()))
        self._user_memo = user_memo

        mig_actions = self._plan_mig(snapshot, cluster, mig_demand, doomed, now)
        actions.extend(mig_actions)
        actions.extend(self._plan_mig_mode(snapshot, cluster, head, mig_demand, mig_actions, now))
        if not self._preempting:
            waiting = self._waiting_interactive(now)
            if waiting is not None:
                actions.extend(self._preempt(cluster, waiting, now, reserved, snapshot.checkpoint,
                                             snapshot.checkpoint_moves))
            elif head is not None:
                actions.extend(self._preempt(cluster, head, now, reserved, snapshot.checkpoint,
                                             snapshot.checkpoint_moves))
        return actions

    def _resume_yielded(self, cluster: Cluster, yielded: frozenset[int]) -> list[Action]:
        """Shares suspended in place continue once the job they yielded to is no longer waiting and
        their compute is free again, before anything new may take it (they hold their memory all
        along), oldest suspension first."""
        out: list[Action] = []
        # Compute freed for a job that has not started yet is that job's: nothing on its device
        # continues before it starts (another share stopped earlier would take it).
        awaited = {u for jid in yielded if (w := self._yielded_for.get(jid)) is not None
                   and self.queue.get(w) is not None for u in cluster.devices_of(jid)}
        for jid in sorted(yielded, key=lambda j: (self._preempting.get(j, 0.0), j)):
            self._preempting.pop(jid, None)  # carried out: the next preemption may be chosen
            if awaited.intersection(cluster.devices_of(jid)):
                continue
            if cluster.paused(jid) and cluster.unpause(jid):
                self._yielded_for.pop(jid, None)
                out.append(ResumeJob(jid, "its compute is free again: continues where it stopped"))
        return out

    # ---- state sync ----------------------------------------------------------------------
    def _observe_shape(self, snapshot: Snapshot) -> None:
        """Re-check satisfiability of everything pending when the node's shape changes."""
        seen = (snapshot.gpus, snapshot.share_modes, snapshot.dynamic)
        if self._shape is not None and all(a is b for a, b in zip(seen, self._shape_seen, strict=True)):
            return  # the very same objects as last pass (the engine reuses them until something changes)
        self._shape_seen = seen
        shape = (tuple((g.index, g.model, g.mig_enabled, g.memory_total_mib,
                        tuple(sorted((i.profile, i.memory_mib) for i in g.instances))) for g in snapshot.gpus),
                 tuple(sorted(snapshot.share_modes.items())), snapshot.dynamic)
        if shape == self._shape:
            return
        self._shape = shape
        self._gpus = snapshot.gpus
        self._share_modes = dict(snapshot.share_modes)
        self._dynamic = snapshot.dynamic
        self._fail_cache = {}
        for jid in list(self.queue.job_ids()):
            job = self.queue.get(jid)
            assert job is not None
            reason = self._unsat(job)
            if reason is not None:
                self.remove(jid)
                self._failed[jid] = reason
                self._to_fail.append(FailJob(jid, f"unsatisfiable: {reason}"))

    def _sync_pending(self, pending: Iterable[Job]) -> None:
        want = {j.id: j for j in pending if j.state is JobState.PENDING}
        have = self.queue.job_ids()
        for jid in have - want.keys():
            self.remove(jid)
        for jid in [j for j in self._failed if j not in want]:
            del self._failed[jid]
        for jid in want.keys() - have:
            self.submit(want[jid])

    def _sync_active(self, active: Iterable[Job], now: float) -> None:
        """Charge every active job for the time since its last charge; settle jobs that ended."""
        seen: set[int] = set()
        touched: set[str] = set()
        first = self._started_at_first_plan if self._started_at_first_plan is not None else now
        for job in active:
            if job.state not in ACTIVE_STATES or job.allocation is None:
                continue
            seen.add(job.id)
            rec = self._active.get(job.id)
            running = job.state is not JobState.SUSPENDED
            if rec is None:  # started before this scheduler existed (restart) or outside it
                started = job.started_at if job.started_at is not None else now
                rec = _Active(job.user, job.uid, job.allocation.compute_fraction, max(started, first),
                              running, job.spec.requeue, started, job, job.allocation, self.estimator.predict(job))
                self._active[job.id] = rec
                self._count_running(rec, +1)
                touched.add(job.user)
            if now > rec.last_charge:
                if rec.running and self._accrue(rec, rec.fraction * (now - rec.last_charge)):
                    touched.add(rec.user)  # v moved: the user's deadline did (within a commitment it does not)
                rec.last_charge = now
            if running != rec.running:
                rec.running = running
                touched.add(rec.user)
        for jid in [j for j in self._active if j not in seen]:
            rec = self._active.pop(jid)
            if rec.running and now > rec.last_charge:
                self._accrue(rec, rec.fraction * (now - rec.last_charge))
            if rec.committed > rec.used:  # settle: refund what was committed and not used
                self.fair.charge(rec.user, 0.0, virtual_gpu_s=rec.used - rec.committed)
                self._outstanding(rec.user, rec.used - rec.committed)
            self._count_running(rec, -1)
            self._no_checkpoint.discard(jid)
            self._yielded_for.pop(jid, None)
            if self._preempting.pop(jid, None) is None:
                self._times_preempted.pop(jid, None)  # ended for good
            touched.add(rec.user)
        for user in sorted(touched):  # sorted: replay must not depend on PYTHONHASHSEED
            self._sync_user(user)

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

    def _outstanding(self, user: str, delta: float) -> None:
        """Keep FairShare's view of each user's unused commitments (where joiners land) current."""
        value = self._unused.get(user, 0.0) + delta
        if value > 1e-9:
            self._unused[user] = value
        else:
            self._unused.pop(user, None)
            value = 0.0
        self.fair.set_outstanding(user, value)

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
        elif self._running_jobs.get(user, 0) <= 0:
            self.fair.deactivate(user)

    def _track_idle(self, snapshot: Snapshot, now: float) -> None:
        """Remember since when each MIG instance has been idle (hysteresis for destroying it)."""
        busy = busy_uuids(snapshot.active)
        present: set[str] = set()
        for gpu in snapshot.gpus:
            for inst in gpu.instances:
                present.add(inst.uuid)
                if inst.uuid in busy:
                    self._idle_since.pop(inst.uuid, None)
                else:
                    self._idle_since.setdefault(inst.uuid, now)
        if len(self._idle_since) > len(present):
            self._idle_since = {u: t for u, t in self._idle_since.items() if u in present}
        for gpu in snapshot.gpus:
            if gpu.index not in snapshot.dynamic:
                continue
            if gpu.uuid in busy or any(i.uuid in busy for i in gpu.instances):
                self._gpu_idle_since.pop(gpu.index, None)
            else:
                self._gpu_idle_since.setdefault(gpu.index, now)

    # ---- decisions -----------------------------------------------------------------------
    def _place(self, cluster: Cluster, job: Job, reserved: frozenset[str],
               claimed: frozenset[str] = frozenset()) -> Allocation | None:
        """Place with the pass's exclusions: interactive-only devices, instances the head claimed."""
        forbidden = claimed if job.spec.job_class == "interactive" else reserved | claimed
        pinned = self._pinned.get(job.id)
        if pinned is not None:  # a checkpointed job resumes on the devices that hold its state
            forbidden = forbidden | (frozenset(cluster.devices) - pinned)
        across = self.config.mps_across_users
        any_uid = across == "always" or (across == "interactive" and job.spec.job_class == "interactive")
        return cluster.place(job, forbidden=forbidden, mps_any_uid=any_uid)

    def _start(self, cluster: Cluster, job: Job, alloc: Allocation, now: float, reason: str) -> StartJob:
        cluster.commit(job, alloc)
        self._sigs.pop(job.id, None)
        self._interactive_pending.pop(job.id, None)
        self._pinned.pop(job.id, None)
        if self._head_id == job.id:
            self._head_id = None
        predicted = self.queue.expected_of(job)
        self.queue.remove(job.id)
        self._pending_since.pop(job.id, None)
        rec = _Active(job.user, job.uid, alloc.compute_fraction, now, True, job.spec.requeue, now, job, alloc,
                      predicted)
        rec.committed = self.fair.commitment(request_fraction(job.spec.request), predicted)
        self._active[job.id] = rec
        self._count_running(rec, +1)
        self.fair.charge(job.user, 0.0, virtual_gpu_s=rec.committed)
        self._outstanding(job.user, rec.committed)
        self._sync_user(job.user)
        return StartJob(job.id, alloc, reason, predicted)

    def _fair_reason(self, job: Job) -> str:
        lag_h = self.fair.lag(job.user) / 3600
        elig = "eligible" if self.fair.is_eligible(job.user) else "no eligible user waiting"
        return f"fair share: {job.user} {elig}, earliest deadline (lag {lag_h:+.2f} GPU-h)"

    def _reserve(self, cluster: Cluster, job: Job, now: float, reserved: frozenset[str],
                 fingerprint: tuple[object, ...]) -> _Reservation:
        """When would the blocked head fit, releasing active jobs in order of their expected end?

        The answer depends only on the head, what is held, the reserved devices and the expected
        ends, so a pass in which none of them changed reuses the last one.
        """
        ends = sorted((self._expected_end(rec, now) if jid not in self._preempting else now, jid)
                      for jid, rec in self._active.items() if jid in cluster.held)
        key = (job.id, fingerprint, reserved, tuple(ends), now if ends and ends[0][0] <= now else None)
        cached = self._reserve_memo
        if cached is not None and cached[0] == key:
            r = cached[1]
            return _Reservation(r.job_id, r.at, r.uuids, r.served_by_ends)
        res = self._reserve_fresh(cluster, job, now, reserved, ends)
        self._reserve_memo = (key, _Reservation(res.job_id, res.at, res.uuids, res.served_by_ends))
        return res

    def _reserve_fresh(self, cluster: Cluster, job: Job, now: float, reserved: frozenset[str],
                       ends: list[tuple[float, int]]) -> _Reservation:
        sim = cluster.copy()
        need_whole = job.spec.request.gpus if isinstance(job.spec.request, WholeRequest) else 0
        # A one-device request that does not fit now can fit only on a device a release touched:
        # try those alone (a 1g job, once 30 jobs end one by one, is 30 small placements, not 30 full ones).
        single = need_whole <= 1
        everything = frozenset(sim.devices)
        freed: set[str] = set()
        for end, jid in ends:
            if single:
                freed.update(sim.devices_of(jid))
            sim.release(jid)
            if need_whole > 1 and sim.idle_whole() < need_whole:
                continue  # cannot fit yet: skip the full placement
            alloc = self._place(sim, job, reserved | (everything - freed) if single else reserved)
            if alloc is not None:
                return _Reservation(job.id, max(end, now), frozenset(alloc.uuids))
        return _Reservation(job.id, math.inf, frozenset(), served_by_ends=False)

    def _mig_claim(self, snapshot: Snapshot, job: Job) -> frozenset[str]:
        """Instances a MIG head needs destroyed on a dynamic GPU; backfill must leave them idle.

        Asks the planner where the head's profile would go if every instance could be destroyed
        (fewest slices lost); the instances in the way are claimed, so they go idle, outlive the
        hysteresis timer and are replaced, instead of being refilled by smaller jobs forever.
        """
        req = job.spec.request
        if not isinstance(req, MigRequest) or not snapshot.dynamic:
            return frozenset()
        gpus = [g for g in snapshot.gpus if g.index in snapshot.dynamic and g.mig_enabled]
        everyone = {i.uuid: float("-inf") for g in gpus for i in g.instances}
        relaxed = plan_dynamic(gpus, frozenset(), [req.profile], idle_since=everyone, now=0.0,
                               policy=MigPolicy(0.0, 0.0), unschedulable=snapshot.unschedulable)
        return frozenset(d.uuid for d in relaxed.destroys)

    def _backfill_ok(self, job: Job, alloc: Allocation, now: float) -> tuple[bool, str]:
        """May `job` start in a hole without delaying the fairness head's reserved start?"""
        res = self._reservation
        if res is None:
            return True, self._fair_reason(job)
        limit = job.spec.time_limit_s
        if not res.served_by_ends:
            return True, f"backfill: job {res.job_id}, next by fairness, does not wait for running jobs"
        if not (set(alloc.uuids) & res.uuids):
            return True, f"backfill: uses no device reserved for job {res.job_id}"
        head_waited = now - self._pending_since.get(res.job_id, now)
        if head_waited < self.config.reserve_after_s:
            return True, (f"backfill: job {res.job_id}, next by fairness, has waited {head_waited:.0f} s, less than "
                          f"reserve_after_s = {self.config.reserve_after_s:.0f} s")
        if math.isfinite(res.at):
            if limit is not None and now + limit <= res.at:
                return True, f"backfill: time limit ends before job {res.job_id}'s reserved start"
            expected = self.queue.expected_of(job)
            if now + expected <= res.at:
                return True, (f"backfill: expected to end ({expected:.0f} s) before job {res.job_id}'s reserved "
                              f"start in {res.at - now:.0f} s")
            return False, (f"would delay job {res.job_id}, next by fairness, reserved to start in "
                           f"{res.at - now:.0f} s")
        if limit is not None and limit <= self.config.backfill_unknown_horizon_s:
            return True, (f"backfill: job {res.job_id}'s start is unknown; time limit within "
                          f"{self.config.backfill_unknown_horizon_s:.0f} s")
        return False, (f"waiting behind job {res.job_id}, next by fairness (only jobs with a time limit "
                       f"<= {self.config.backfill_unknown_horizon_s:.0f} s may backfill)")

    def _need(self, job: Job, cluster: Cluster) -> str:
        req = job.spec.request
        if isinstance(req, WholeRequest):
            kept = sum(1 for u in self._headroom if (d := cluster.devices.get(u)) is not None
                       and d.kind == "gpu" and d.idle) if job.spec.job_class != "interactive" else 0
            note = f", {kept} of them kept for interactive work" if kept else ""
            return f"waiting for {req.gpus} whole GPU(s) ({cluster.idle_whole()} idle now{note})"
        if isinstance(req, MigRequest):
            return f"waiting for a free {req.profile}"
        return f"waiting for a share of {req.fraction:g} with {req.gpu_mem_mib} MiB on an mps/timeslice device"

    def _plan_mig(self, snapshot: Snapshot, cluster: Cluster, demand: list[str], doomed: frozenset[str],
                  now: float) -> list[Action]:
        if not demand or not snapshot.dynamic:
            return []
        gpus = [g for g in snapshot.gpus if g.index in snapshot.dynamic and g.mig_enabled]
        busy = {u for u, d in cluster.devices.items() if not d.idle} | busy_uuids(snapshot.active)
        pending_profiles = {j.spec.request.profile for jid in self._blocked
                            if (j := self.queue.get(jid)) is not None and isinstance(j.spec.request, MigRequest)}
        mplan = plan_dynamic(gpus, busy, demand, pending_profiles=pending_profiles, claimed=doomed,
                             idle_since=self._idle_since,
                             last_reconfig=self._last_reconfig, now=now, policy=self.config.mig,
                             unschedulable=snapshot.unschedulable)
        for g in mplan.gpus_changed:
            self._last_reconfig[g] = now
        out: list[Action] = [DestroyInstance(d.uuid, d.reason) for d in mplan.destroys]
        out += [CreateInstance(c.gpu_index, c.profile, c.start, c.reason) for c in mplan.creates]
        return out

    def _plan_mig_mode(self, snapshot: Snapshot, cluster: Cluster, head: Job | None, mig_demand: list[str],
                       mig_actions: list[Action], now: float) -> list[Action]:
        """Switch idle dynamic GPUs out of MIG mode when the blocked fairness head needs whole GPUs
        that only they can give, and into it when MIG work finds no dynamic GPU to go on.

        Only a GPU idle for `min_idle_s` and not reconfigured for `min_reconfig_interval_s` is
        switched (the same damping as instances), and only when the switch completes what is needed:
        the 8-GPU pod gets its 8 GPUs, not a GPU that would idle until the others free up.
        """
        policy = self.config.mig
        if not policy.toggle_mode or not snapshot.dynamic:
            return []

        touched = {a.gpu_index for a in mig_actions if isinstance(a, CreateInstance)} | {
            g.index for g in snapshot.gpus for a in mig_actions if isinstance(a, DestroyInstance)
            for i in g.instances if i.uuid == a.uuid}

        def switchable(gpu: Gpu) -> bool:
            idle = self._gpu_idle_since.get(gpu.index)
            return (gpu.index in snapshot.dynamic and gpu.index not in touched
                    and gpu.uuid not in snapshot.unschedulable and idle is not None
                    and now - idle >= policy.min_idle_s
                    and now - self._last_reconfig.get(gpu.index, -math.inf) >= policy.min_reconfig_interval_s)

        usable = [g for g in snapshot.gpus if g.uuid not in snapshot.unschedulable]
        req = head.spec.request if head is not None else None
        if isinstance(req, WholeRequest):
            whole = sum(1 for g in usable if not g.mig_enabled)
            if whole >= req.gpus:
                return []
            cands = [g for g in usable if g.mig_enabled and switchable(g)]
            if whole + len(cands) < req.gpus:
                return []  # switching would not make the head fit: keep the MIG capacity
            out: list[Action] = []
            for gpu in cands[: req.gpus - whole]:
                self._last_reconfig[gpu.index] = now
                out += [DestroyInstance(i.uuid, f"GPU {gpu.index} leaves MIG mode") for i in gpu.instances]
                out.append(SetMigMode(gpu.index, False, f"job {head.id if head else '?'} needs {req.gpus} whole "
                                      f"GPU(s); GPU {gpu.index} has been idle in MIG mode"))
            return out
        if mig_demand and not mig_actions:  # the dynamic GPUs in MIG mode could not make room for it
            cands = [g for g in usable if not g.mig_enabled and switchable(g)
                     and (d := cluster.devices.get(g.uuid)) is not None and d.idle]
            if cands:
                gpu = cands[0]
                self._last_reconfig[gpu.index] = now
                return [SetMigMode(gpu.index, True, f"MIG work waits ({', '.join(sorted(set(mig_demand)))}) and no "
                                   f"dynamic GPU in MIG mode has room; GPU {gpu.index} has been idle")]
        return []

    def _park_remembered(self, head: Job, fails: set[object],
                         user_memo: dict[str, tuple[int, frozenset[object], tuple[str, ...]]],
                         mig_demand: list[str]) -> None:
        """Park, in one sweep, every user whose candidates all failed last pass with nothing freed
        or queued for them since; picking them one by one would rescan the order for each (O(u^2))."""
        for user in self.queue.users():
            if user != head.user:
                self._park_if_remembered(user, fails, user_memo, mig_demand)

    def _park_if_remembered(self, user: str, fails: set[object],
                            user_memo: dict[str, tuple[int, frozenset[object], tuple[str, ...]]],
                            mig_demand: list[str]) -> bool:
        """Park the user if everything of theirs this pass would try failed last pass, and nothing
        has been freed or queued for them since (their explanations from then still hold)."""
        memo = self._user_memo.get(user)
        if memo is None or memo[0] != self.queue.version(user) or not memo[1] <= fails:
            return False
        user_memo[user] = memo
        for profile in memo[2]:  # their blocked MIG jobs still count as creation demand
            if len(mig_demand) < self.config.max_mig_demand:
                mig_demand.append(profile)
        self.queue.park(user)
        return True

    def _plan_headroom(self, cluster: Cluster, snapshot: Snapshot, now: float) -> frozenset[str]:
        """Devices kept for interactive work this pass (core/interactive.py)."""
        running = sum(rec.fraction for rec in self._active.values() if rec.job.spec.job_class == "interactive")
        self._demand.observe(now, running + sum(self._interactive_pending.values()))
        cap = min(self.config.interactive_headroom_gpus,
                  math.floor(len(snapshot.gpus) * self.config.interactive_headroom_fraction + 1e-9))
        n = self._demand.devices_needed(now, cap)
        if n == 0:
            self._headroom = frozenset()
            return self._headroom
        interactive_on = frozenset(u for rec in self._active.values() if rec.job.spec.job_class == "interactive"
                                   for u in rec.alloc.uuids)
        ends: dict[str, float] = {}
        for jid, rec in self._active.items():
            if jid in cluster.held:
                end = self._expected_end(rec, now)
                for u in rec.alloc.uuids:
                    ends[u] = max(ends.get(u, 0.0), end)
        self._headroom = choose_headroom(cluster, n, interactive_on, ends, snapshot.reserved_interactive)
        return self._headroom

    def _waiting_interactive(self, now: float) -> Job | None:
        """The interactive job that has waited longest, if past `interactive_preempt_after_s`."""
        bound = self.config.interactive_preempt_after_s
        if bound is None or not self._interactive_pending:
            return None
        jid = min(self._interactive_pending, key=lambda j: (self._pending_since.get(j, now), j))
        if now - self._pending_since.get(jid, now) < bound:
            return None
        return self.queue.get(jid)

    def _resume_devices(self, alloc: Allocation, moves: bool) -> frozenset[str]:
        """Where a checkpointed job may resume: its own GPUs, or (when the driver can map devices on
        restore) any whole GPU of the same model."""
        if not moves:
            return frozenset(alloc.uuids)
        models = {g.model for g in self._gpus if g.uuid in alloc.uuids}
        return frozenset(g.uuid for g in self._gpus if g.model in models and not g.mig_enabled)

    def _preempt(self, cluster: Cluster, job: Job, now: float, reserved: frozenset[str],
                 checkpoint: bool, moves: bool = False) -> list[Action]:
        """Preempt batch jobs of users above share so a long-waiting job fits (core/preempt.py).

        For the fairness head (its freed devices go to it, not to a backfill job that would only be
        preempted again) or an interactive job waiting past its bound. Checkpointable whole-GPU
        jobs go first (nothing is lost), then `--requeue` jobs within their user's daily budget.
        """
        interactive = job.spec.job_class == "interactive"
        since = self._pending_since.get(job.id, job.submitted_at)
        waited = now - max(job.submitted_at, since)
        if interactive:
            bound = self.config.interactive_preempt_after_s
            if bound is None or waited < bound:
                return []
        else:
            bound = self.config.preempt_after_s
            res = self._reservation
            if bound is None or waited < bound or self.fair.lag(job.user) <= 0:
                return []  # a batch job of a user at or above share waits its turn
            if res is None or res.at - now <= self.config.preempt_min_gain_s:
                return []  # running jobs will make room soon enough without losing work
        my_lag = self.fair.lag(job.user)
        margin = self.config.preempt_lag_margin_gpu_s
        cap = self.config.preempt_max_per_job
        cands: list[Candidate] = []
        for jid, rec in self._active.items():
            if (rec.user == job.user or jid not in cluster.held or rec.job.spec.job_class == "interactive"
                    or (cap and self._times_preempted.get(jid, 0) >= cap)
                    or self.fair.lag(rec.user) >= min(my_lag - margin, -margin)):
                continue
            whole = rec.alloc.share is None and all(d.kind == "gpu" for d in rec.alloc.devices)
            lost = rec.fraction * (now - rec.started)
            # For the head, a victim must have run preempt_min_run_s whatever the mode, or a job
            # started in a pass is preempted in the same pass and the two swap places for ever.
            # An interactive job's victims stand on its headroom, where no batch job starts anew.
            if rec.started >= now or (not interactive and now - rec.started < self.config.preempt_min_run_s):
                continue
            share = rec.alloc.share is not None and rec.running
            if share and self.config.preempt_suspend_shares and any(
                    (d := cluster.devices.get(u)) is not None and d.shared for u in rec.alloc.uuids):
                cands.append(Candidate(jid, "suspend", (0, self.fair.lag(rec.user), -rec.started), 0.0))
            elif checkpoint and whole and rec.running and jid not in self._no_checkpoint:
                cands.append(Candidate(jid, "checkpoint", (0, self.fair.lag(rec.user), -rec.started), 0.0))
            elif rec.requeue and self._budget.left(rec.user, now) >= lost:
                cands.append(Candidate(jid, "requeue", (1, self.fair.lag(rec.user), -rec.started), lost))
        if not cands:
            return []
        # Whether any set of these victims makes room depends only on what is held, the waiting job
        # and who may be stopped how: a search that found none is not repeated until one changes.
        memo_key = (cluster.fingerprint(), job.id, reserved, tuple(sorted((c.job_id, c.mode) for c in cands)))
        if self._no_victims == memo_key:
            return []
        victims = choose_victims(cluster, cands, lambda sim: self._place(sim, job, reserved) is not None)
        if not victims:
            self._no_victims = memo_key
            return []
        out: list[Action] = []
        for cand in victims:
            rec = self._active[cand.job_id]
            self._preempting[cand.job_id] = now
            self._times_preempted[cand.job_id] = self._times_preempted.get(cand.job_id, 0) + 1
            if cand.mode == "checkpoint":
                self._pinned[cand.job_id] = self._resume_devices(rec.alloc, moves)
            elif cand.mode == "requeue":
                self._budget.spend(rec.user, now, cand.lost_gpu_s)
            else:
                self._yielded_for[cand.job_id] = job.id
            how = {"checkpoint": "checkpointed", "suspend": "suspended in place, keeps its GPU memory"}.get(
                cand.mode, f"requeued, {cand.lost_gpu_s:.0f} GPU-s lost")
            out.append(PreemptJob(cand.job_id, (
                f"preempted ({how}) for job {job.id} ({job.user}, {job.spec.job_class}, waiting "
                f"{waited:.0f} s); {rec.user} is {-self.fair.lag(rec.user) / 3600:.2f} GPU-h above share"),
                cand.mode))
        return out

    # ---- explainability ------------------------------------------------------------------
    def expected_end(self, job_id: int) -> float | None:
        """When a running job is expected to end (never before k x its elapsed time); None if unknown."""
        rec = self._active.get(job_id)
        return self._expected_end(rec, self._last_now) if rec is not None else None

    def expected_start(self, job_id: int, max_ahead: int = 500) -> float | None:
        """When a pending job is expected to start if nothing new arrives: None if it cannot be told.

        Plays the queue forward from the last pass: running jobs end at their expected ends, pending
        jobs start in fairness order as soon as they fit (no backfill, so this errs late) and run
        for their estimates. Jobs that need a MIG change, or more than `max_ahead` jobs ahead of it,
        make the answer unknown rather than wrong.
        """
        if self._cluster is None or job_id not in self.queue:
            return None
        now = self._last_now
        order = self.queue.ordered_jobs(limit=max_ahead + 1)
        if job_id not in order:
            return None
        sim = self._cluster.copy()
        ends: list[tuple[float, int]] = sorted(
            (self._expected_end(rec, now), jid) for jid, rec in self._active.items() if jid in sim.held)
        t = now
        for jid in order:
            job = self.queue.get(jid)
            assert job is not None
            alloc = self._place(sim, job, frozenset())
            while alloc is None and ends:
                t = max(t, ends[0][0])
                sim.release(ends.pop(0)[1])
                alloc = self._place(sim, job, frozenset())
            if alloc is None:
                return None
            if jid == job_id:
                return t
            sim.commit(job, alloc)
            bisect.insort(ends, (t + self.queue.expected_of(job), jid))
        return None

    def fairness_order(self) -> list[int]:
        """Pending job ids in the order they would be served (O(n log u); for `gpusched queue`)."""
        return self.queue.ordered_jobs()

    def explain(self, job_id: int) -> str:
        """Why a pending job is waiting, in words: what it needs, its owner's standing, its place."""
        if job_id in self._failed:
            return f"job {job_id} cannot run on this node: {self._failed[job_id]}"
        job = self.queue.get(job_id)
        if job is None:
            return f"job {job_id} is not pending"
        order = self.queue.ordered_jobs()
        ahead = order.index(job_id) if job_id in order else len(order)
        lag_h = self.fair.lag(job.user) / 3600
        if abs(lag_h) < 0.005:
            standing = f"{job.user} is at their share"
        elif lag_h < 0:
            standing = f"{job.user} is {-lag_h:.2f} GPU-h above their share"
        else:
            standing = f"{job.user} is {lag_h:.2f} GPU-h below their share"
        if not self.fair.is_eligible(job.user):
            standing += " (not eligible until others catch up)"
        parts = [f"job {job_id} ({describe_request(job.spec.request)}, {job.spec.job_class})"]
        blocked = self._blocked.get(job_id, "waiting behind the jobs ahead of it by fairness")
        if blocked is None:
            blocked = self._need(job, self._cluster) if self._cluster is not None else "no room for it yet"
        parts.append(blocked)
        parts.append(standing)
        parts.append(f"{ahead} job(s) ahead by fairness")
        res = self._reservation
        if res is not None and res.job_id == job_id and math.isfinite(res.at):
            parts.append(f"expected to start in about {res.at - self._last_now:.0f} s")
        return "; ".join(parts)


def _signature(job: Job) -> tuple[object, ...]:
    """What decides whether a job fits: its request (and uid for shares: MPS serves one uid) and class.

    Plain tuples: hashing the pydantic request models dominated the pass on long queues.
    """
    req = job.spec.request
    if isinstance(req, WholeRequest):
        return ("g", req.gpus, job.spec.job_class)
    if isinstance(req, MigRequest):
        return ("m", req.profile, job.spec.job_class)
    return ("s", req.fraction, req.gpu_mem_mib, job.uid, job.spec.job_class)
