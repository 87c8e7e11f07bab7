"""What the scheduler has learned and counted, kept in the store's meta table across restarts and
crashes: each user's place (fair-share standing), the preemption budgets spent and each job's
preemption count, the interactive demand that sizes the headroom, the held head, when each GPU's
MIG layout last changed, and the run times the estimates come from."""

from __future__ import annotations

import json
import logging
from typing import Any

from gpusched.core.sched_persist import HANDED_OVER
from gpusched.daemon.store import Store
from gpusched.policy import CarriesOver

log = logging.getLogger("gpusched.engine")


def hand_over(old: Any, new: Any) -> None:
    """A reload's new policy instance takes what the old one learned: through its own carry_over
    when it has one (and is of the same class), else every HANDED_OVER record both can give and take."""
    if type(new) is type(old) and isinstance(new, CarriesOver):
        new.carry_over(old)
        return
    for _, exporter_name, loader_name, _ in HANDED_OVER:
        exporter, loader = getattr(old, exporter_name, None), getattr(new, loader_name, None)
        if callable(exporter) and callable(loader):
            loader(exporter())


def load_scheduler_state(store: Store, scheduler: Any) -> None:
    """Give a fresh scheduler what the last one saved (a scheduler without a loader skips it)."""
    for key, _, loader_name, cost in HANDED_OVER:
        saved = store.get_meta(key)
        loader = getattr(scheduler, loader_name, None)
        if saved and callable(loader):
            try:
                loader(json.loads(saved))
            except Exception as exc:  # a damaged record costs what it held, never the start
                log.warning("ignoring the saved %s (%s): %s", key, cost, exc)


def scheduler_state(scheduler: Any, *, history: bool) -> dict[str, str]:
    """Every record as the store keeps it (key -> JSON); the run times only with `history` (they can
    be megabytes: the engine saves them at most once a minute, and at shutdown)."""
    out: dict[str, str] = {}
    for key, exporter_name, _, _ in HANDED_OVER:
        exporter = getattr(scheduler, exporter_name, None)
        if callable(exporter) and (history or key != "runtime_history"):
            out[key] = json.dumps(exporter())
    return out


def save_scheduler_state(store: Store, scheduler: Any, *, history: bool, with_next_commit: bool = False) -> None:
    """Save every record (that changed) in one COMMIT of its own, or, `with_next_commit`, in the next
    COMMIT the store makes for anything (Store.meta_with_next_commit)."""
    store.meta_with_next_commit(scheduler_state(scheduler, history=history))
    if not with_next_commit:
        store.commit_meta()
