"""The runnable queue: users ordered by virtual deadline, each user's jobs by (nice, expected run time,
submission).

Two levels because fairness is between users, not jobs: a user with 10,000 queued jobs is one
entry in the user order, so the cost of a pick depends on the number of users with work, not on
the number of jobs. Submit and remove are O(log n) on sortedcontainers; re-keying a user is a bisect
in the user order (a plain list: users number in the hundreds).

Picking follows EEVDF: among *eligible* users (fairshare.is_eligible) the earliest virtual
deadline; if no waiting user is eligible (the owed users are all running), the earliest deadline
anyway, so a free GPU is never left idle for bookkeeping reasons. Finding the first eligible user
scans the deadline order; the kernel avoids the scan with a min-v augmented tree, we accept it
because users with work number in the hundreds, and ineligible users sort late (their deadline
starts from a larger virtual runtime).

Within a user, shorter expected jobs go first among those submitted together (shortest-expected-
first lowers the user's own mean wait without changing their share), without starving a long job
(see `job_key`). A job's expected run time is fixed when it enters the queue, so its place cannot
shift under it while it waits.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from sortedcontainers import SortedList

from gpusched.core.fairshare import NICE0_WEIGHT, FairShare
from gpusched.gpu.amd_profiles import PARTITIONS_PER_MODE
from gpusched.model import Job, MigRequest, PartitionRequest, ShareRequest, WholeRequest

# (nice, submitted_at + expected run time, expected run time, id); the id is the job's own int
# object (`shared_id`), which a key of every queued job would otherwise hold a copy of.
JobKey = tuple[int, float, float, Any]
UserKey = tuple[float, str]  # (virtual deadline, user)


def shared_id(job: Job) -> Any:
    """`job.id` as the int object the job holds, for a table that keeps one entry per job.

    Compiled (gpusched/native.py), `job.id` is read into a machine integer, and each table that
    stores it boxes it again: a new int object per table per queued job (about 15 MiB of RSS at 100k
    queued jobs, docs/benchmarks.md). Read from the model's own fields it stays one object, as it
    is when this module runs as Python."""
    return job.__dict__["id"]


def job_key(job: Job, expected_s: float = 0.0, job_id: Any = None) -> JobKey:
    """Order within a user: lower nice first, then the earliest 'expected end had it started when
    submitted' (submitted_at + expected run time), then id.

    Among jobs submitted together that is shortest-expected-first; across time it is first come,
    first served, so a long job is never starved by a stream of shorter ones submitted after it
    (once newer jobs' submission times pass its key, they all sort behind it).

    `job_id`: `shared_id(job)`, where the caller has it already (a restart files 100k jobs).
    """
    return (job.spec.nice, job.submitted_at + expected_s, expected_s, shared_id(job) if job_id is None else job_id)


def request_fraction(request: WholeRequest | MigRequest | ShareRequest | PartitionRequest,
                     mig_fraction: float = 1.0 / 7) -> float:
    """Compute fraction a request will be charged at, for deadlines (before it is placed).

    A MIG profile `Ng.*` is charged at about N/7 of a GPU; the exact SM ratio is known only once
    the instance is chosen, and the deadline needs only the order of magnitude.
    """
    if isinstance(request, WholeRequest):
        return float(request.gpus)
    if isinstance(request, MigRequest):
        return int(request.profile.split("g", 1)[0]) * mig_fraction
    if isinstance(request, PartitionRequest):
        return request.gpus / PARTITIONS_PER_MODE[request.mode]
    return request.fraction


@dataclass(slots=True)
class _UserQueue:
    jobs: SortedList  # of JobKey
    key: UserKey | None = None  # current entry in RunQueue._order


class RunQueue:
    """Pending jobs. The scheduler owns activation in FairShare; this class owns order only."""

    def __init__(self, fair: FairShare, expected: Callable[[Job], float] | None = None,
                 revision: Callable[[], int] | None = None) -> None:
        """`revision` (optional) changes whenever `expected` may answer differently: while it does
        not, a user's deadline offset (what their head job adds to v) is reused by `rekey`."""
        self.fair = fair
        self._expected_of = expected or (lambda job: fair.config.batch_quantum_s)
        self._revision = revision
        # user -> (head job, revision, weight, deadline - v, the head's expected run time then): v
        # moves on every charge, the rest rarely
        self._offsets: dict[str, tuple[Job, int, float, float, float]] = {}
        self._jobs: dict[int, Job] = {}
        self._keys: dict[int, JobKey] = {}
        self._users: dict[str, _UserQueue] = {}
        # Users by key, a plain sorted list: users with work number in the hundreds, where bisect and
        # a memmove beat SortedList's bookkeeping (a pass re-keys a few users and scans from the front).
        self._order: list[UserKey] = []
        self._parked: set[str] = set()
        self._skip = 0  # the first _skip entries of _order are parked (a pass parks users in order)
        self._versions: dict[str, int] = {}  # user -> bumped whenever their pending jobs change
        # AMD compute mode -> logical GPUs pending `--partition` jobs ask for: the partition planner
        # reads it every pass on AMD nodes, so it is kept as jobs come and go, not counted
        self._partition_demand: dict[str, int] = {}
        # `--gpus N` -> how many pending jobs ask it: the partition planner must not leave the node
        # fewer logical GPUs than the largest asks (it would become unsatisfiable by our own doing)
        self._whole_sizes: dict[int, int] = {}

    # ---- membership ----------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    def get(self, job_id: int) -> Job | None:
        return self._jobs.get(job_id)

    def job_ids(self) -> set[int]:
        return set(self._jobs)

    def partition_demand(self) -> dict[str, int]:
        """Compute mode -> logical GPUs the pending `--partition` jobs ask for (a copy)."""
        return dict(self._partition_demand)

    def largest_whole(self) -> int:
        """The most whole GPUs a pending `--gpus N` job asks for (0 with none)."""
        return max(self._whole_sizes, default=0)

    def _count_demand(self, job: Job, sign: int) -> None:
        """Keep `partition_demand` and `largest_whole` as a job comes (+1) or goes (-1)."""
        req = job.spec.request
        # By its `kind`, not isinstance: a pydantic class's isinstance runs ABCMeta's check, twice a job
        # at a restart's 100k (compiled, a field's read is half of one).
        if req.kind == "partition":
            mode = req.mode
            left = self._partition_demand.get(mode, 0) + sign * req.gpus
            if left > 0:
                self._partition_demand[mode] = left
            else:
                self._partition_demand.pop(mode, None)
        elif req.kind == "whole":
            gpus = req.gpus
            jobs = self._whole_sizes.get(gpus, 0) + sign
            if jobs > 0:
                self._whole_sizes[gpus] = jobs
            else:
                self._whole_sizes.pop(gpus, None)

    def has_user(self, user: str) -> bool:
        return user in self._users

    def users(self) -> list[str]:
        return list(self._users)

    def jobs_of(self, user: str) -> Iterator[Job]:
        """A user's pending jobs in the order they would be served."""
        uq = self._users.get(user)
        if uq is None:
            return
        for key in uq.jobs:
            yield self._jobs[key[3]]

    def submit(self, job: Job) -> None:
        """Add a pending job (idempotent: a job already held is replaced)."""
        key = self._file(job, shared_id(job))
        uq = self._users.get(job.user)
        if uq is None:
            uq = _UserQueue(SortedList())
            self._users[job.user] = uq
        head_before = uq.jobs[0] if uq.jobs else None
        uq.jobs.add(key)
        self._versions[job.user] = self._versions.get(job.user, 0) + 1
        if head_before is None or uq.jobs[0] != head_before:
            self.rekey(job.user)

    def submit_many(self, jobs: list[Job]) -> None:
        """What `submit` of each job in turn leaves (a job given twice: its last copy), each user's new
        jobs sorted once and the user re-keyed once: a restart hands over its whole queue at once."""
        latest = {shared_id(job): job for job in jobs}
        by_user: dict[str, list[JobKey]] = {}
        for job_id, job in latest.items():
            key = self._file(job, job_id)
            user = job.user
            keys = by_user.get(user)
            if keys is None:
                keys = by_user[user] = []
            keys.append(key)
        for user, keys in by_user.items():
            uq = self._users.get(user)
            if uq is None:
                uq = self._users[user] = _UserQueue(SortedList(keys))
                head_before = None
            else:
                head_before = uq.jobs[0] if uq.jobs else None
                uq.jobs.update(keys)
            self._versions[user] = self._versions.get(user, 0) + 1
            if head_before is None or uq.jobs[0] != head_before:
                self.rekey(user)

    def _file(self, job: Job, job_id: Any) -> JobKey:
        """Enter a job (`job_id`: its shared_id) in the tables (replacing an earlier copy) and return its
        key in its user's queue, for the caller to add there."""
        if job_id in self._jobs:
            self.remove(job_id)
        self._jobs[job_id] = job
        self._count_demand(job, 1)
        key = job_key(job, self._expected_of(job), job_id)
        self._keys[job_id] = key
        return key

    def remove(self, job_id: int, *, rekey: bool = True) -> Job | None:
        """Drop a job (started, cancelled, held, failed). Returns it, or None if unknown.

        `rekey=False`: the caller re-keys the user itself before the order is read again (a start
        charges the user first, and one re-key then does for both)."""
        job = self._jobs.pop(job_id, None)
        if job is None:
            return None
        self._count_demand(job, -1)
        uq = self._users[job.user]
        key = self._keys.pop(job_id)
        was_head = uq.jobs[0] == key
        uq.jobs.remove(key)
        self._versions[job.user] = self._versions.get(job.user, 0) + 1
        if not uq.jobs:
            if uq.key is not None:
                self._unorder(uq.key)
            del self._users[job.user]
            self._parked.discard(job.user)
            self._offsets.pop(job.user, None)
        elif was_head and (rekey or not self.fair.is_active(job.user)):
            self.rekey(job.user)
        return job

    def expected_of(self, job: Job) -> float:
        """The estimate of the moment for a job (history may have grown since it was filed)."""
        return self._expected_of(job)

    def version(self, user: str) -> int:
        """Changes whenever the user's pending jobs change (lets a pass skip a user it already tried)."""
        return self._versions.get(user, 0)

    def expected(self, job_id: int) -> float:
        """The expected run time a queued job was filed with (its place among its user's jobs).

        Charges and deadlines use the estimate of the moment (`expected_of`), which learns from
        jobs that ended since; only the order within a user is fixed at filing.
        """
        return self._keys[job_id][2]

    def head(self, user: str) -> Job | None:
        uq = self._users.get(user)
        return self._jobs[uq.jobs[0][3]] if uq is not None and uq.jobs else None

    # ---- order ---------------------------------------------------------------------------
    def deadline_of(self, user: str) -> float:
        """Virtual deadline of the user's head job."""
        head = self.head(user)
        if head is None:
            return float("inf")
        v = self.fair.v(user)
        if self._revision is None:
            return self._deadline(user, head, v)
        revision, weight = self._revision(), self.fair.weight(user)
        cached = self._offsets.get(user)
        if cached is not None and cached[0] is head and cached[2] == weight:
            if cached[1] == revision:
                return v + cached[3]
            # something was learned, mostly about other jobs: the offset stands if the estimate does
            expected = self._expected_of(head)
            if expected == cached[4]:
                self._offsets[user] = (head, revision, weight, cached[3], expected)
                return v + cached[3]
        else:
            expected = self._expected_of(head)
        offset = self._offset(user, head, expected)
        self._offsets[user] = (head, revision, weight, offset, expected)
        return v + offset

    def _deadline(self, user: str, job: Job, v: float) -> float:
        return v + self._offset(user, job)

    def _offset(self, user: str, job: Job, expected_s: float | None = None) -> float:
        """What the job's request adds to v for its deadline: fraction·request_s·100/w."""
        fair = self.fair
        expected = self._expected_of(job) if expected_s is None else expected_s
        request_s = fair.request_length(expected, job.spec.job_class)
        return request_fraction(job.spec.request) * request_s * NICE0_WEIGHT / fair.weight(user)

    def rekey(self, user: str) -> None:
        """Recompute a user's place after their v, rate, weight or head job changed. O(log n)."""
        uq = self._users.get(user)
        if uq is None:
            return
        if uq.key is not None:
            self._unorder(uq.key)
            uq.key = None
        if not self.fair.is_active(user):
            self.fair.activate(user, self._jobs[uq.jobs[0][3]].uid)
        uq.key = (self.deadline_of(user), user)
        bisect.insort(self._order, uq.key)
        self._skip = 0

    def _unorder(self, key: UserKey) -> None:
        order = self._order
        self._skip = 0
        i = bisect.bisect_left(order, key)
        if i == len(order) or order[i] != key:
            raise ValueError(f"{key!r} not in the user order")
        del order[i]

    def pick(self) -> str | None:
        """The user to serve next: earliest deadline among eligible users, else earliest overall.

        Users parked for this pass are skipped (they keep their place in the order, so ending the
        pass costs nothing).
        """
        first: str | None = None
        parked = self._parked
        eligible = self.fair.eligibility()
        order = self._order
        skip = self._skip
        while skip < len(order) and order[skip][1] in parked:
            skip += 1
        self._skip = skip
        for entry in order[skip:] if skip else order:
            user: str = entry[1]
            if user in parked:
                continue
            if first is None:
                first = user
            if eligible(user):
                return user
        return first

    def park(self, user: str) -> None:
        """Skip a user for the rest of a pass (nothing of theirs can start now)."""
        if user in self._users:
            self._parked.add(user)

    def unpark_all(self) -> None:
        """End of pass: every parked user is a candidate again."""
        self._parked = set()
        self._skip = 0

    def ordered_jobs(self, limit: int | None = None) -> list[int]:
        """Pending job ids in the order they would be served if each started at once.

        Replays the pass's picks: a start commits the job's expected service to its user's v (as
        `Scheduler` does), which moves their deadline and V. So while nothing else changes, this is
        exactly the order of the next starts. O(n log u).
        """
        fair = self.fair
        sum_w = fair.total_weight()
        wv_sum = fair.V() * sum_w  # Σ w·v over active users
        v: dict[str, float] = {}
        pos: dict[str, int] = {}
        keys: dict[str, list[JobKey]] = {}
        order: SortedList = SortedList()
        for user, uq in self._users.items():
            keys[user] = list(uq.jobs)
            pos[user] = 0
            v[user] = fair.v(user) if fair.is_active(user) else fair.V()
            order.add((self.deadline_of(user), user))
        out: list[int] = []
        while order and (limit is None or len(out) < limit):
            V = wv_sum / sum_w if sum_w > 0 else fair.V()
            chosen = None
            for entry in order:
                if v[entry[1]] <= V + 1e-9:
                    chosen = entry
                    break
            if chosen is None:
                chosen = order[0]
            order.remove(chosen)
            user = chosen[1]
            ks = keys[user]
            job = self._jobs[ks[pos[user]][3]]
            out.append(job.id)
            pos[user] += 1
            w = fair.weight(user)
            dv = fair.commitment(request_fraction(job.spec.request), self._expected_of(job)) * NICE0_WEIGHT / w
            v[user] += dv
            if fair.is_active(user):
                wv_sum += w * dv
            if pos[user] < len(ks):
                order.add((self._deadline(user, self._jobs[ks[pos[user]][3]], v[user]), user))
        return out
