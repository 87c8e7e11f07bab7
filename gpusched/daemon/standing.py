"""What the scheduler has learned and counted, kept in the store's meta table across restarts and
crashes: each user's place (fair-share standing), the preemption budgets spent and each job's
preemption count, the interactive demand that sizes the headroom, the held head, when each GPU's
MIG layout last changed, and the run times the estimates come from."""

from __future__ import annotations

import json
import logging
from typing import Any

from gpusched.daemon.store import Store

log = logging.getLogger("gpusched.engine")

# meta key -> (the scheduler's loader, what a damaged record costs)
_LOADERS = {
    "standing": ("load_standing", "every user starts at lag 0"),
    "preemptions": ("load_preemptions", "the preemption budgets and counts start afresh"),
    "interactive_demand": ("load_demand", "the interactive headroom starts from current demand"),
    "charged_until": ("load_charged_until", "the downtime is not charged to the jobs that ran through it"),
    "held_head": ("load_held_head", "the held head waits its turn again"),
    "mig_damping": ("load_mig_damping", "a GPU may be repartitioned before min_reconfig_interval_s"),
    "runtime_history": ("load_history", "estimates start from the defaults"),
}


def load_scheduler_state(store: Store, scheduler: Any) -> None:
    """Give a fresh scheduler what the last one saved (a scheduler without a loader skips it)."""
    for key, (loader_name, cost) in _LOADERS.items():
        saved = store.get_meta(key)
        loader = getattr(scheduler, loader_name, None)
        if saved and callable(loader):
            try:
                loader(json.loads(saved))
            except Exception as exc:  # a damaged record costs what it held, never the start
                log.warning("ignoring the saved %s (%s): %s", key, cost, exc)


def save_scheduler_state(store: Store, scheduler: Any, *, history: bool) -> None:
    """Save the standing and the preemption record (one COMMIT), and with `history` the run times
    too (they can be megabytes: the engine saves them at most once a minute, and at shutdown)."""
    with store.batch():
        for key, exporter_name in (("standing", "export_standing"), ("preemptions", "export_preemptions"),
                                   ("interactive_demand", "export_demand"), ("charged_until", "export_charged_until"),
                                   ("held_head", "export_held_head"), ("mig_damping", "export_mig_damping"),
                                   *((("runtime_history", "export_history"),) if history else ())):
            exporter = getattr(scheduler, exporter_name, None)
            if callable(exporter):
                store.set_meta(key, json.dumps(exporter()))
