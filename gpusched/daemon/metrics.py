"""Prometheus metrics: off unless `metrics_address` is set; see docs/metrics.md for every series.

Two halves:
- `Metrics` (in daemon/counters.py, so the engine need not import this module) holds what can only
  be counted as it happens (queue waits, pass times, XIDs, MIG reconfigurations). The engine owns one
  (`engine.metrics`) and calls its hooks; they are cheap and always on, so the engine never asks
  whether metrics are being served.
- `EngineCollector` reads everything else from the engine's state at scrape time (jobs by state,
  per-user service and share, per-device allocation and health), so nothing can drift out of step.

`MetricsServer` serves `GET /metrics` with a small asyncio HTTP handler on the daemon's own loop:
a scrape then reads engine state on the thread that changes it, with no locks and no races.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpusched import __version__
from gpusched.config import split_host_port
from gpusched.model import ACTIVE_STATES, TERMINAL_STATES, Job, JobState

if TYPE_CHECKING:
    from gpusched.daemon.engine import Engine

log = logging.getLogger("gpusched.metrics")

UNFINISHED_STATES: tuple[JobState, ...] = tuple(s for s in JobState if s not in TERMINAL_STATES)


@dataclass(frozen=True, slots=True)
class _Device:
    gpu: str
    uuid: str
    kind: str
    profile: str
    gpu_uuid: str


class EngineCollector:
    """A prometheus_client Collector that reads the engine at scrape time (call on the engine's loop)."""

    def __init__(self, engine: Engine, backend_name: str = "") -> None:
        self.engine = engine
        self.backend_name = backend_name
        # GPU index -> its UUID when last seen: a GPU that falls off the bus leaves the inventory, and
        # its series must turn 0, not vanish (an alert on `== 0` would never fire)
        self._gpu_uuids: dict[int, str] = {}

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        jobs = list(engine.jobs.values())

        info = GaugeMetricFamily("gpusched_build_info", "The running gpuschedd: version and GPU backend.",
                                 labels=["version", "backend"])
        info.add_metric([__version__, self.backend_name], 1.0)
        yield info

        by_state = GaugeMetricFamily("gpusched_jobs", "Unfinished jobs by state.", labels=["state"])
        counts = {state: 0 for state in UNFINISHED_STATES}
        for job in jobs:
            if job.state in counts:
                counts[job.state] += 1
        for state, count in counts.items():
            by_state.add_metric([state.value], float(count))
        yield by_state

        yield CounterMetricFamily("gpusched_scheduler_passes", "Scheduling passes since the daemon started.",
                                  value=float(engine.passes))
        # Their ratio is how many submits one fsync made durable (group commit, daemon/groupcommit.py).
        yield CounterMetricFamily("gpusched_group_commits", "COMMITs (each one fsync) that made submits durable.",
                                  value=float(engine.commits.commits))
        yield CounterMetricFamily("gpusched_group_commit_writes",
                                  "Submits (a job, or an array with its tasks) those COMMITs made durable.",
                                  value=float(engine.commits.writes))

        yield from self._users(jobs)
        yield from self._devices(jobs)
        yield from engine.metrics.collect()

    def _users(self, jobs: list[Job]) -> Iterator[Metric]:
        export = getattr(self.engine.scheduler, "export_standing", None)
        standing: dict[str, Any] = dict(export()) if callable(export) else {}
        service = CounterMetricFamily(
            "gpusched_user_service_gpu_seconds",
            "GPU-seconds charged to each user (compute fraction x wall time), as the fair-share scheduler counts them.",
            labels=["user"],
        )
        lag = GaugeMetricFamily(
            "gpusched_user_lag_gpu_seconds",
            "Fair-share lag: GPU-seconds a user is owed (positive) or has had beyond their share (negative).",
            labels=["user"],
        )
        for user, row in sorted(standing.items()):
            if "service" in row:
                service.add_metric([user], float(row["service"]))
            if "lag" in row:
                lag.add_metric([user], float(row["lag"]))
        if standing:
            yield service
            yield lag

        capacity = float(len(self.engine.inventory.gpus))
        held: dict[str, float] = dict.fromkeys(standing, 0.0)
        for job in jobs:
            if job.state in ACTIVE_STATES and job.allocation is not None:
                held[job.user] = held.get(job.user, 0.0) + job.allocation.compute_fraction
        share = GaugeMetricFamily(
            "gpusched_user_share_ratio",
            "Fraction of the node's GPU compute (1 per GPU) that each user's jobs hold now.",
            labels=["user"],
        )
        if capacity > 0:
            for user, fraction in sorted(held.items()):
                share.add_metric([user], fraction / capacity)
        yield share

    def _devices(self, jobs: list[Job]) -> Iterator[Metric]:
        inventory = self.engine.inventory
        devices: list[_Device] = []
        for gpu in inventory.gpus:
            self._gpu_uuids[gpu.index] = gpu.uuid
            if gpu.mig_enabled:
                devices.extend(_Device(str(gpu.index), i.uuid, "mig", i.profile, gpu.uuid)
                               for i in sorted(gpu.instances, key=lambda i: i.start))
            else:
                devices.append(_Device(str(gpu.index), gpu.uuid, "gpu", "", gpu.uuid))
        allocated: dict[str, float] = {}
        for job in jobs:
            if job.state in ACTIVE_STATES and job.allocation is not None:
                part = job.allocation.share if job.allocation.share is not None else 1.0
                for uuid in job.allocation.uuids:
                    allocated[uuid] = allocated.get(uuid, 0.0) + part
        labels = ["gpu", "uuid", "kind", "profile"]
        alloc = GaugeMetricFamily(
            "gpusched_device_allocated",
            "Fraction of each device (whole GPU or MIG instance) allocated to jobs: 1 = exclusive, shares add up.",
            labels=labels,
        )
        healthy = GaugeMetricFamily(
            "gpusched_device_healthy", "1 if the device can be scheduled, 0 if it is in error or drained.",
            labels=labels,
        )
        drain_reason = getattr(getattr(self.engine, "devices", None), "drain_reason", None)
        bad_gpus = {str(index) for index in inventory.errors}
        for dev in devices:
            values = [dev.gpu, dev.uuid, dev.kind, dev.profile]
            alloc.add_metric(values, min(1.0, allocated.get(dev.uuid, 0.0)))
            ok = dev.gpu not in bad_gpus
            if ok and callable(drain_reason):
                ok = drain_reason(dev.uuid) is None and drain_reason(dev.gpu_uuid) is None
            healthy.add_metric(values, 1.0 if ok else 0.0)
        seen = {gpu.index for gpu in inventory.gpus}
        for index in sorted(set(inventory.errors) - seen):  # lost or unreadable: out of service, not gone
            values = [str(index), self._gpu_uuids.get(index, ""), "gpu", ""]
            alloc.add_metric(values, 0.0)
            healthy.add_metric(values, 0.0)
        yield alloc
        yield healthy


class MetricsServer:
    """`GET /metrics` over HTTP/1.1 on the daemon's event loop; one request per connection."""

    MAX_HEADER_BYTES = 16 * 1024

    TIMEOUT_S = 10.0  # to send a request's head, and to take the reply

    def __init__(self, engine: Engine, address: str, backend_name: str = "", max_connections: int = 32) -> None:
        self.host, self.requested_port = split_host_port(address)
        # Its own cap, well below the daemon's file limit: a flood of scrapes is closed at once instead
        # of taking the descriptors the control socket, the database and job launches need.
        self.max_connections = max_connections
        self.open_connections = 0
        self.refused_connections = 0
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(engine, backend_name))
        self.port = 0  # the bound port, known after start() (metrics_address may ask for port 0)
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.requested_port,
                                                  limit=self.MAX_HEADER_BYTES)
        self.port = int(self._server.sockets[0].getsockname()[1])
        log.info("serving Prometheus metrics on http://%s/metrics", self.url_host)

    @property
    def url_host(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.open_connections >= self.max_connections:
            self.refused_connections += 1
            writer.transport.abort()  # no reply: answering would itself hold the descriptor longer
            return
        self.open_connections += 1
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.TIMEOUT_S)
            lines = head.decode("latin-1").split("\r\n")
            method, target, *_ = [*lines[0].split(" "), "", ""]
            headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:] if h)}
            path = target.split("?", 1)[0]
            if method not in ("GET", "HEAD"):
                await _respond(writer, 405, b"only GET\n", "text/plain; charset=utf-8", {"Allow": "GET, HEAD"})
            elif path not in ("/metrics", "/"):
                await _respond(writer, 404, b"metrics are at /metrics\n", "text/plain; charset=utf-8")
            else:
                encoder, content_type = choose_encoder(headers.get("accept", ""))
                body = encoder(self.registry)
                await _respond(writer, 200, body, content_type, head_only=method == "HEAD")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            pass
        except Exception:  # a scrape must never take the daemon down
            log.exception("metrics request failed")
            with contextlib.suppress(Exception):
                await _respond(writer, 500, b"internal error\n", "text/plain; charset=utf-8")
        finally:
            self.open_connections -= 1
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), self.TIMEOUT_S)


_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 500: "Internal Server Error"}


async def _respond(writer: asyncio.StreamWriter, status: int, body: bytes, content_type: str,
                   extra: dict[str, str] | None = None, head_only: bool = False) -> None:
    headers = {"Content-Type": content_type, "Content-Length": str(len(body)), "Connection": "close",
               **(extra or {})}
    head = f"HTTP/1.1 {status} {_REASONS[status]}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    writer.write(head.encode("latin-1") + b"\r\n" + (b"" if head_only else body))
    await asyncio.wait_for(writer.drain(), MetricsServer.TIMEOUT_S)  # a scraper that stops reading is dropped
