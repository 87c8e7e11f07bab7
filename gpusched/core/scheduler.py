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

from collections.abc import Iterable, Mapping

from gpusched.core.actions import (
    Action,
    CreateInstance,
    DestroyInstance,
    FailJob,
    PreemptJob,
    ResumeJob,
    SetMigMode,
    SetPartitionMode,
    Snapshot,
    StartJob,
    busy_uuids,
)
from gpusched.core.estimate import Estimate, RuntimeEstimator
from gpusched.core.fairshare import FairShare
from gpusched.core.fifo import FifoScheduler, schedulable_devices
from gpusched.core.interactive import InteractiveDemand
from gpusched.core.placement import Cluster
from gpusched.core.preempt import LossBudget
from gpusched.core.queue import RunQueue, request_fraction, shared_id
from gpusched.core.sched_core import (
    Candidate,
    FailMemo,
    ReserveArgs,
    ScanEntry,
    SchedulerConfig,
    Shapes,
    UserMemo,
    Wording,
    _Active,
    _Reservation,
    unsatisfiable_reason,
)
from gpusched.core.sched_persist import PersistMixin
from gpusched.gpu.backend import Gpu
from gpusched.model import (
    Job,
    JobState,
    MigRequest,
    pending_since,
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
    "SetPartitionMode",
    "Snapshot",
    "StartJob",
    "busy_uuids",
    "schedulable_devices",
    "unsatisfiable_reason",
]


class Scheduler(PersistMixin):
    """Fair share (EEVDF over users) + placement + dynamic MIG + backfill + preemption.

    Its parts are one chain of classes, each module adding one concern to the one before
    (sched_core, sched_reserve, sched_sync, sched_mig, sched_scan, sched_preempt, sched_explain,
    sched_persist), not mixins side by side: mypyc compiles single inheritance only (gpusched/native.py).

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
        self.queue = RunQueue(self.fair, expected=self.estimator.predict, revision=lambda: self.estimator.revision)
        self.incremental = incremental
        self._active: dict[int, _Active] = {}
        self._unused: dict[str, float] = {}  # user -> GPU-s committed by running jobs, not used yet
        self._running_jobs: dict[str, int] = {}
        self._failed: dict[int, str] = {}  # failed job id -> reason (until it leaves pending)
        self._to_fail: list[FailJob] = []
        self._fail_cache: dict[object, str | None] = {}
        self._last_unsat: tuple[object, object, str | None] = (None, None, None)  # (_fail_cache, request, reason)
        self._shape: object = None
        self._shape_seen: tuple[object, ...] = (None, None, None)
        self._gpus: tuple[Gpu, ...] = ()
        self._share_modes: Mapping[str, str] = {}
        self._dynamic: frozenset[int] = frozenset()
        self._idle_since: dict[str, float] = {}
        self._last_reconfig: dict[int, float] = {}
        self._gpu_idle_since: dict[int, float] = {}  # dynamic GPU -> since when nothing has run on it
        self._part_idle_since: dict[int, float] = {}
        self._part_last_reconfig: dict[int, float] = {}
        self._preempting: dict[int, float] = {}
        self._started_at_first_plan: float | None = None
        self._charged_until: float | None = None  # a restart's standing charged running jobs up to here
        # pending job id -> why it did not start in the last pass; None: it did not fit, and what it
        # needs is worded only when someone asks (against the pass's final placement state)
        self._blocked: dict[int, str | Wording | None] = {}
        self._reservation: _Reservation | None = None
        self._reserve_args: ReserveArgs | None = None
        self._last_now = 0.0
        self._last_pending: tuple[Job, ...] | None = None  # identity fast path for an unchanged tuple
        self._pending_since: dict[int, float] = {}  # when a job (last) became pending, for waits
        self._times_preempted: dict[int, int] = {}
        # The job that was next by fairness and blocked: it stays first until it starts, so a big job
        # cannot lose its reservation to whoever is most owed a moment later (it would starve).
        self._head_id: int | None = None
        self._cluster: Cluster | None = None
        # The placement view kept from pass to pass (sched_sync._cluster_for), and what it was built for
        self._live: Cluster | None = None
        self._live_gpus: tuple[Gpu, ...] | None = None
        self._live_shape: tuple[object, ...] = ()
        self._reserve_memo: tuple[object, tuple[int | None, frozenset[str]]] | None = None
        # what backfill scans of each user, kept until their queue changes (sched_core._candidates)
        self._scan: dict[str, ScanEntry] = {}
        self._shapes: dict[str, tuple[list[Candidate], Shapes]] = {}  # what of _scan backfill needs
        self._demand = InteractiveDemand(self.config.interactive_window_s)
        self._interactive_pending: dict[int, float] = {}  # pending interactive job -> GPUs' worth
        self._headroom: frozenset[str] = frozenset()
        self._reserved: frozenset[str] = frozenset()  # the last pass's devices for interactive work only
        self._budget = LossBudget(self.config.preempt_budget_gpu_s)
        self._pinned: dict[int, frozenset[str]] = {}  # checkpointed job -> the devices it resumes on
        self._no_checkpoint: set[int] = set()  # running jobs the engine could not checkpoint
        self._yielded_for: dict[int, int] = {}  # share suspended in place -> the job it stopped for
        self._no_victims: object = None  # the last victim search that found none (see _preempt)
        # Requests that found no room in the last pass, valid while the cluster is the same (see plan).
        self._fail_memo: FailMemo | None = None
        self._refit: tuple[frozenset[object], frozenset[str]] | None = None
        # user -> (queue version, signatures tried, MIG profiles they asked for) in the last pass
        self._user_memo: UserMemo = {}

    def observe_end(self, job: Job) -> None:
        """A job ended for good: learn its run time if it ran to its own end (or its limit).

        Cancelled, lost and preempted runs say nothing about how long the job needs.
        """
        if (job.state in (JobState.COMPLETED, JobState.FAILED, JobState.TIMEOUT)
                and job.started_at is not None and job.ended_at is not None):
            self.estimator.observe(job, job.ended_at - job.started_at)

    def forget_ended(self, job_id: int) -> None:
        """A job ended for good, whatever its state was (a requeued job cancelled while it waited, too):
        nothing of it is kept (its preemption count would stay in the saved record for ever)."""
        self._times_preempted.pop(job_id, None)
        self._no_checkpoint.discard(job_id)

    def estimate(self, job: Job) -> Estimate:
        """The run-time estimate a job is (or would be) scheduled with, and where it came from."""
        return self.estimator.estimate(job)

    def submit(self, job: Job) -> None:
        """A job became PENDING (submitted, released from HELD, requeued after preemption)."""
        if self._admit(job):
            self.queue.submit(job)

    def submit_many(self, jobs: list[Job]) -> None:
        """What `submit` of each job in turn does, the queue sorted once (a restart's whole queue)."""
        self.queue.submit_many([job for job in jobs if self._admit(job)])

    def _admit(self, job: Job) -> bool:
        """A job's entry in everything but the queue; False if it is not to be queued (it cannot run here)."""
        job_id = shared_id(job)  # the job's own int object: one entry per queued job (queue.shared_id)
        if job_id in self._failed:
            return False
        if self._shape is None:  # node not seen yet: the first plan checks every queued job
            self._pending_since.setdefault(job_id, pending_since(job))  # its history: a restart keeps the wait
        else:
            reason = self._unsat(job)
            if reason is not None:
                self._failed[job.id] = reason
                self._to_fail.append(FailJob(job.id, f"unsatisfiable: {reason}"))
                return False
            self._pending_since.setdefault(job_id, max(pending_since(job), self._last_now))
        if job.spec.job_class == "interactive":
            self._interactive_pending[job.id] = request_fraction(job.spec.request)
        return True

    def remove(self, job_id: int) -> None:
        """A job left PENDING other than by our StartJob (cancelled, held, failed elsewhere)."""
        job = self.queue.remove(job_id)
        self._interactive_pending.pop(job_id, None)
        self._pinned.pop(job_id, None)
        if self._head_id == job_id:
            self._head_id = None
        self._pending_since.pop(job_id, None)
        self._failed.pop(job_id, None)
        self._blocked.pop(job_id, None)
        if job is not None:
            self._sync_user(job.user)

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

        cluster = self._cluster_for(snapshot)
        actions.extend(self._resume_yielded(cluster, snapshot.yielded))
        reserved = snapshot.reserved_interactive | self._plan_headroom(cluster, snapshot, now)
        self._reserved = reserved  # (what `expected_start` and `_need` must keep batch jobs off too)
        self._reservation = None
        self._reserve_args = None
        self._refit = None
        head: Job | None = None
        fails: set[object] = set()
        mig_demand: list[str] = []
        # what the head's reconfiguration needs idle: MIG instances, or AMD logical GPUs to change mode
        doomed: frozenset[str] = frozenset()
        remembered = False  # fails were carried over from the last pass (nothing freed since)
        user_memo: UserMemo = {}
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
                    doomed = self._mig_claim(snapshot, job) | self._partition_claim(snapshot, job)
                    # worked out when first read (sched_reserve.py): most passes never need it
                    self._reserve_args = (cluster, job, now, reserved, fingerprint, doomed)
                    self._blocked[job.id] = "next by fairness; " + self._need(job, cluster)
                    memo = self._fail_memo
                    if memo is not None and memo.reserved == reserved and memo.doomed == doomed:
                        if memo.head_id == job.id and memo.fingerprint == fingerprint:
                            fails |= memo.fails  # nothing was freed since they failed: they fail again
                            remembered = True
                            self._park_remembered(head, fails, user_memo, mig_demand)
                        elif memo.cluster is cluster:
                            # only what the frees since could help is asked again
                            fails |= self._still_failing(cluster, memo)
                            remembered = True
                            self._park_remembered(head, fails, user_memo, mig_demand)
                    if not self.config.backfill:
                        # Strict order, but the devices kept for interactive work still serve it:
                        # else a head that needs them and the interactive jobs they are kept for
                        # would wait for each other for as long as interactive demand lasts.
                        self._start_on_headroom(cluster, reserved, doomed, now, actions)
                        break
                    # The head's own user is not parked: their other jobs may backfill too (a MIG job
                    # behind their blocked whole-GPU job should not idle a free instance).
                    continue
                if not cluster.has_room():
                    break
                if remembered and self._park_if_remembered(user, fails, user_memo, mig_demand, head.id):
                    continue
                scanned += self._backfill_user(cluster, user, head.id, reserved, doomed, fails, mig_demand, now,
                                               actions, user_memo)
        finally:
            self.queue.unpark_all()
        self._cluster = cluster  # what is held after this pass: `expected_start` plays forward from it
        self._fail_memo = (FailMemo(cluster.fingerprint(), reserved, doomed, head.id, frozenset(fails), cluster,
                                    cluster.free_mark())
                           if fails and head is not None else None)
        self._user_memo = user_memo

        mig_actions = self._plan_mig(snapshot, cluster, mig_demand, doomed, now)
        actions.extend(mig_actions)
        actions.extend(self._plan_mig_mode(snapshot, cluster, head, mig_demand, mig_actions, now))
        actions.extend(self._plan_partitions(snapshot, cluster, head, reserved, now))
        if not self._preempting:
            waiting = self._waiting_interactive(now)
            if waiting is not None:
                actions.extend(self._preempt(cluster, waiting, now, reserved, snapshot.checkpoint,
                                             snapshot.checkpoint_moves))
            elif head is not None:
                actions.extend(self._preempt(cluster, head, now, reserved, snapshot.checkpoint,
                                             snapshot.checkpoint_moves))
        return actions

    def _start_on_headroom(self, cluster: Cluster, reserved: frozenset[str], doomed: frozenset[str], now: float,
                           actions: list[Action]) -> None:
        """With backfill off: start pending interactive jobs on the devices kept for them only."""
        if not reserved:
            return
        elsewhere = frozenset(cluster.devices) - reserved
        for job_id in list(self._interactive_pending):
            job = self.queue.get(job_id)
            if job is None or not cluster.has_room():
                continue
            alloc = self._place(cluster, job, reserved, doomed | elsewhere)
            if alloc is not None:
                actions.append(self._start(cluster, job, alloc, now, "interactive work on the devices kept for it "
                                                                      "(backfill is off)"))

    def _observe_shape(self, snapshot: Snapshot) -> None:
        """Re-check satisfiability of everything pending when the node's shape changes."""
        seen = (snapshot.gpus, snapshot.share_modes, snapshot.dynamic)
        last = self._shape_seen
        if self._shape is not None and seen[0] is last[0] and seen[1] is last[1] and seen[2] is last[2]:
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

