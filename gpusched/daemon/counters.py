"""What the engine counts as it happens, for /metrics (daemon/metrics.py serves it).

Kept apart from metrics.py so that the engine, which feeds these hooks, does not import the module
that reads the engine at scrape time: the daemon reads as layers (engine below metrics), not a loop.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import Counter, Histogram
from prometheus_client.metrics_core import Metric

# Queue waits run from a second to days; scheduler passes from well under a millisecond to seconds.
QUEUE_WAIT_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 14400.0,
                      28800.0, 86400.0, 172800.0, float("inf"))
PASS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, float("inf"))

class Metrics:
    """Counters and histograms fed by the engine as things happen (thread-safe)."""

    def __init__(self) -> None:
        # registry=None: these are not registered globally; EngineCollector yields them per daemon.
        self.queue_wait = Histogram(
            "gpusched_queue_wait_seconds", "Time jobs waited PENDING before they started (observed at start).",
            buckets=QUEUE_WAIT_BUCKETS, registry=None,
        )
        self.scheduler_pass = Histogram(
            "gpusched_scheduler_pass_seconds", "Wall time of one scheduling pass (plan and apply).",
            buckets=PASS_BUCKETS, registry=None,
        )
        self.mig_reconfigurations = Counter(
            "gpusched_mig_reconfigurations", "MIG instances created or destroyed by the daemon, per GPU.",
            ["gpu"], registry=None,
        )
        self.xids = Counter("gpusched_xid", "XID errors reported by the driver, per GPU and XID.",
                            ["gpu", "xid"], registry=None)

    def observe_wait(self, seconds: float) -> None:
        """A job started after waiting `seconds` (see `pending_since`)."""
        self.queue_wait.observe(max(0.0, seconds))

    def observe_pass(self, seconds: float) -> None:
        self.scheduler_pass.observe(max(0.0, seconds))

    def record_xid(self, gpu: int, xid: int) -> None:
        self.xids.labels(gpu=str(gpu), xid=str(xid)).inc()

    def record_mig_reconfiguration(self, gpu: int) -> None:
        self.mig_reconfigurations.labels(gpu=str(gpu)).inc()

    def collect(self) -> Iterator[Metric]:
        for metric in (self.queue_wait, self.scheduler_pass, self.mig_reconfigurations, self.xids):
            yield from metric.collect()


