"""What a scheduler hands over to the store, and to the next scheduler: each user's standing, the
run-time history, preemption budgets and counts, the interactive demand, up to when running jobs
were charged, the held head and MIG damping. A restart (daemon/standing.py) and a reload
(`carry_over`) keep them, so nobody loses their place and no bound starts over."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpusched.core.sched_explain import ExplainMixin
from gpusched.model import Job

# What a scheduler hands over, as (meta key, exporter, loader, what a damaged record costs): to the
# store across a restart (daemon/standing.py) and to the next scheduler at a reload (carry_over).
# The run times come last: they can be megabytes, and the daemon saves them less often.
HANDED_OVER: tuple[tuple[str, str, str, str], ...] = (
    ("standing", "export_standing", "load_standing", "every user starts at lag 0"),
    ("preemptions", "export_preemptions", "load_preemptions", "the preemption budgets and counts start afresh"),
    ("interactive_demand", "export_demand", "load_demand", "the interactive headroom starts from current demand"),
    ("charged_until", "export_charged_until", "load_charged_until",
     "the downtime is not charged to the jobs that ran through it"),
    ("held_head", "export_held_head", "load_held_head", "the held head waits its turn again"),
    ("mig_damping", "export_mig_damping", "load_mig_damping",
     "a GPU may be repartitioned before min_reconfig_interval_s"),
    ("runtime_history", "export_history", "load_history", "estimates start from the defaults"),
)


class PersistMixin(ExplainMixin):
    """export_* give plain data for the store; load_* restore it before the first plan."""

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

    def load_standing(self, standing: Mapping[str, Mapping[str, float]]) -> None:
        """Restore what export_standing gave; call before the first plan."""
        self.fair.load_standing(standing)

    def export_preemptions(self) -> dict[str, Any]:
        """What preemption has cost so far, for the store: each user's requeue losses of the last day
        (the budget), each job's preemption count (the per-job cap) and the jobs whose checkpoint
        failed (not offered for one again). A restart keeps them."""
        return {"losses": self._budget.export(), "times": {str(j): n for j, n in self._times_preempted.items()},
                "no_checkpoint": sorted(self._no_checkpoint)}

    def load_preemptions(self, saved: Mapping[str, Any]) -> None:
        """Restore what export_preemptions gave; call before the first plan. Malformed parts are skipped."""
        losses = saved.get("losses")
        if isinstance(losses, dict):
            self._budget.load(losses)
        times = saved.get("times")
        if isinstance(times, dict):
            self._times_preempted.update({int(j): n for j, n in times.items()
                                          if isinstance(j, str) and j.isdigit() and isinstance(n, int)})
        refused = saved.get("no_checkpoint")
        if isinstance(refused, list):  # jobs whose checkpoint failed are not offered for one again
            self._no_checkpoint.update(j for j in refused if isinstance(j, int) and not isinstance(j, bool))

    def export_charged_until(self) -> float | None:
        """Up to when the exported standing has charged running jobs (the last pass's time), for the store."""
        return self._last_now if self._started_at_first_plan is not None else None

    def load_charged_until(self, saved: float | None) -> None:
        """Restore what export_charged_until gave; call before the first plan. Jobs that ran on while
        no daemon was there are charged from then, not from this scheduler's first pass: the GPU
        time of the downtime is charged to their users like any other."""
        if isinstance(saved, (int, float)) and not isinstance(saved, bool):
            self._charged_until = float(saved)

    def charge_ended_while_away(self, job: Job) -> None:
        """A job that ran on after the saved standing was taken and ended before this scheduler's
        first pass (while no daemon ran): its user is charged the GPU time from where the standing
        stopped charging it to its end, as a job still running at the restart is charged for the
        downtime. Call before the first plan."""
        if self._charged_until is None or job.ended_at is None or job.allocation is None:
            return
        since = max(self._charged_until, job.started_at if job.started_at is not None else self._charged_until)
        service = job.allocation.compute_fraction * max(0.0, job.ended_at - since)
        if service > 0:
            self.fair.charge(job.user, service)

    def export_held_head(self) -> int | None:
        """The job holding its place at the head (`hold_head_after_s`), for the store."""
        return self._head_id

    def load_held_head(self, saved: int | None) -> None:
        """Restore what export_held_head gave; call before the first plan. A job no longer queued by
        then is simply not found, and the order is read as usual."""
        if isinstance(saved, int) and not isinstance(saved, bool):
            self._head_id = saved

    def export_mig_damping(self) -> dict[str, float]:
        """When each GPU's MIG layout or mode last changed (`min_reconfig_interval_s` counts from it),
        and each AMD physical GPU's partition mode, under `p<index>`."""
        return {**{str(g): at for g, at in self._last_reconfig.items()},
                **{f"p{g}": at for g, at in self._part_last_reconfig.items()}}

    def load_mig_damping(self, saved: Mapping[str, object]) -> None:
        """Restore what export_mig_damping gave; call before the first plan. A restart does not let a
        GPU be repartitioned sooner than the interval allows (a record from before partitions has
        no `p` keys, and one from a later version may have keys this one skips). `object`, not
        float: compiled, a declared float would turn a stored `true` into 1.0 before the check."""
        for key, at in saved.items():
            if not isinstance(at, (int, float)) or isinstance(at, bool):
                continue
            if key.isdigit():
                self._last_reconfig[int(key)] = float(at)
            elif key.startswith("p") and key[1:].isdigit():
                self._part_last_reconfig[int(key[1:])] = float(at)

    def export_demand(self) -> list[list[float]]:
        """The interactive demand of the last window (what sizes the headroom), for the store."""
        return self._demand.export()

    def load_demand(self, saved: Sequence[Sequence[float]]) -> None:
        """Restore what export_demand gave; call before the first plan. After a restart the headroom
        stays for interactive users active within the window, as it would have without one."""
        self._demand.load(saved)

    def carry_over(self, old: PersistMixin) -> None:
        """A reload's new scheduler (new weights, quanta or limits) keeps what the old one learned and
        counted: every record a restart keeps (HANDED_OVER), handed over the same way. Call before
        the first plan."""
        for _, exporter, loader, _ in HANDED_OVER:
            getattr(self, loader)(getattr(old, exporter)())
