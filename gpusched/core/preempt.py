"""Choosing what to preempt, and how, so a waiting job gets room at the least cost.

Preemption is the fallback (docs/scheduling.md): it runs only for the fairness head that has waited
`preempt_after_s`, or for an interactive job that has waited `interactive_preempt_after_s`. Each
victim is stopped the cheapest way its hardware allows:

- `checkpoint`: a whole-GPU job (MIG off) on a node with cuda-checkpoint: its GPU state is moved to
  host memory, the GPU is free, and the job resumes later where it was; no work is lost.
- `suspend`: a share on an MPS or time-sliced device is stopped in place (SIGSTOP): it keeps its
  GPU memory and its slot, gives up its compute, and continues (SIGCONT) when the compute is free
  again; no work is lost. Only compute is freed, so it helps a job that lacks compute, not memory.
- `requeue`: a `--requeue` job is ended and queued again; the work since its start is lost, so it
  is charged against its user's `preempt_budget_gpu_s` (per day) rather than a per-job cap: a user
  who opted in loses at most that much a day, however many jobs they run.

Pure: the scheduler passes the candidates it may touch, and a function that says whether the
waiting job would fit once some are gone.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from gpusched.core.placement import Cluster

PreemptMode = Literal["requeue", "checkpoint", "suspend"]
DAY_S = 86400.0


@dataclass(frozen=True, slots=True)
class Candidate:
    """A running job that may be preempted, and what it would cost."""

    job_id: int
    mode: PreemptMode
    rank: tuple[float, ...]  # lower goes first
    lost_gpu_s: float  # work lost (0 for checkpoint and suspend)


def choose_victims(cluster: Cluster, candidates: Sequence[Candidate],
                   fits: Callable[[Cluster], bool]) -> list[Candidate] | None:
    """The fewest candidates, taken in rank order, whose going lets the waiting job fit; None if none do.

    Greedy in rank order until it fits, then each victim that turns out not to be needed is spared.
    """
    ranked = sorted(candidates, key=lambda c: (c.rank, c.job_id))
    # Stopping more only frees more, so if stopping them all does not make room, no prefix does:
    # the usual answer (nothing to preempt) costs one placement instead of one per candidate.
    sim = cluster.copy()
    for cand in ranked:
        _free(sim, cand)
    if not fits(sim):
        return None
    sim = cluster.copy()
    taken: list[Candidate] = []
    for cand in ranked:
        _free(sim, cand)
        taken.append(cand)
        if fits(sim):
            break
    else:
        return None
    for cand in list(taken):
        trial = cluster.copy()
        for other in taken:
            if other is not cand:
                _free(trial, other)
        if fits(trial):
            taken.remove(cand)
    return taken


def _free(cluster: Cluster, cand: Candidate) -> None:
    """What stopping a victim frees: everything it holds, or only its compute when suspended in place."""
    if cand.mode == "suspend":
        cluster.pause(cand.job_id)
    else:
        cluster.release(cand.job_id)


class LossBudget:
    """GPU-seconds of work each user has lost to requeue preemption in the last day."""

    def __init__(self, budget_gpu_s: float) -> None:
        self.budget_gpu_s = budget_gpu_s
        self._lost: dict[str, deque[tuple[float, float]]] = {}

    def _window(self, user: str, now: float) -> deque[tuple[float, float]]:
        entries = self._lost.setdefault(user, deque())
        while entries and entries[0][0] <= now - DAY_S:
            entries.popleft()
        return entries

    def left(self, user: str, now: float) -> float:
        return self.budget_gpu_s - sum(g for _, g in self._window(user, now))

    def spend(self, user: str, now: float, gpu_s: float) -> None:
        self._window(user, now).append((now, gpu_s))

    def export(self) -> dict[str, list[list[float]]]:
        """Plain data for the store: per user, [when, GPU-s] of each loss still counted."""
        return {user: [[at, gpu_s] for at, gpu_s in entries] for user, entries in self._lost.items() if entries}

    def load(self, saved: Mapping[str, Sequence[Sequence[float]]]) -> None:
        """Restore what `export` gave; entries that are not [when, GPU-s] pairs of numbers are skipped."""
        for user, entries in saved.items():
            kept = deque((float(e[0]), float(e[1])) for e in entries if isinstance(e, (list, tuple)) and len(e) == 2
                         and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in e))
            if isinstance(user, str) and kept:
                self._lost[user] = kept
