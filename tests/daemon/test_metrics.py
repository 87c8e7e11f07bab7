"""Prometheus metrics: scraped over real HTTP from a real daemon while real jobs run."""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from collections.abc import Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpusched.config import ConfigError, load_config
from gpusched.model import JobSpec, JobState, WholeRequest
from gpusched.protocol import (
    CancelRequest,
    CancelResult,
    ShowRequest,
    ShowResult,
    SimInjectXidRequest,
    SimResult,
    SubmitRequest,
    SubmitResult,
)
from gpusched_cli.client import Client
from tests.conftest import DaemonHandle, wait_until

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int, path: str = "/metrics") -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    """The one sample of `name` whose labels include `labels`."""
    found = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples in {sorted(n for n, _ in samples)}"
    return found[0]


def scrape_when(port: int, name: str, want: float, **labels: str) -> Samples:
    """Scrape until `name{labels}` equals `want` (the daemon acts asynchronously), then return that scrape."""

    def attempt() -> Samples:
        samples = scrape(port)
        found = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
        return samples if found == [want] else {}  # absent until the first event: keep polling

    return wait_until(attempt, what=f"{name}{labels} == {want}")


def submit(c: Client, *argv: str, gpus: int = 1) -> int:
    spec = JobSpec(argv=list(argv), cwd=os.getcwd(), env={"PATH": os.environ["PATH"]}, request=WholeRequest(gpus=gpus))
    return c.call(SubmitRequest(spec=spec), SubmitResult).job_id


def state_of(c: Client, job_id: int) -> JobState:
    return c.call(ShowRequest(job_id=job_id), ShowResult).job.state


def port_of(daemon: DaemonHandle) -> int:
    assert daemon.daemon is not None
    port = daemon.daemon.metrics_port
    assert port is not None and port > 0
    return port


def test_metrics_are_off_unless_configured(daemon: DaemonHandle) -> None:
    assert daemon.daemon is not None
    assert daemon.daemon.metrics is None
    assert daemon.daemon.metrics_port is None


def test_scrape_follows_jobs_devices_users_and_queue_waits(daemon_factory: Callable[..., DaemonHandle]) -> None:
    daemon: DaemonHandle = daemon_factory(metrics_address="127.0.0.1:0")
    port = port_of(daemon)

    idle = scrape(port)
    assert value(idle, "gpusched_build_info", backend="sim") == 1.0
    for state in ("PENDING", "RUNNING", "HELD", "STARTING", "SUSPENDED", "PREEMPTED"):
        assert value(idle, "gpusched_jobs", state=state) == 0.0
    assert not [k for k in idle if k[0] == "gpusched_jobs" and ("state", "COMPLETED") in k[1]]
    devices = {dict(ls)["uuid"]: v for (n, ls), v in idle.items() if n == "gpusched_device_allocated"}
    assert len(devices) == 2 and set(devices.values()) == {0.0}
    assert all(dict(ls)["kind"] == "gpu" and dict(ls)["profile"] == "" for (n, ls) in idle
               if n == "gpusched_device_allocated")
    assert {v for (n, _), v in idle.items() if n == "gpusched_device_healthy"} == {1.0}
    assert value(idle, "gpusched_queue_wait_seconds_count") == 0.0

    with daemon.client() as c:
        blocker = submit(c, "sleep", "30", gpus=2)
        wait_until(lambda: state_of(c, blocker) is JobState.RUNNING, what="blocker running")
        waiting = submit(c, "sleep", "30")
        busy = scrape_when(port, "gpusched_jobs", 1.0, state="PENDING")
        assert value(busy, "gpusched_jobs", state="RUNNING") == 1.0
        allocated = {dict(ls)["uuid"]: v for (n, ls), v in busy.items() if n == "gpusched_device_allocated"}
        assert allocated == dict.fromkeys(devices, 1.0)
        user = c.call(ShowRequest(job_id=blocker), ShowResult).job.user
        assert value(busy, "gpusched_user_share_ratio", user=user) == 1.0  # both GPUs of two
        assert value(busy, "gpusched_queue_wait_seconds_count") == 1.0
        assert value(busy, "gpusched_scheduler_pass_seconds_count") >= 1.0
        assert value(busy, "gpusched_scheduler_passes_total") >= 1.0

        c.call(CancelRequest(job_ids=[blocker]), CancelResult)
        wait_until(lambda: state_of(c, waiting) is JobState.RUNNING, what="the waiting job to start")
        after = scrape_when(port, "gpusched_queue_wait_seconds_count", 2.0)
        assert value(after, "gpusched_queue_wait_seconds_sum") > 0.0  # the second job really waited
        assert value(after, "gpusched_user_share_ratio", user=user) == 0.5
        assert sorted(v for (n, _), v in after.items() if n == "gpusched_device_allocated") == [0.0, 1.0]
        if any(n == "gpusched_user_service_gpu_seconds_total" for n, _ in after):  # the fair-share scheduler
            wait_until(lambda: value(scrape(port), "gpusched_user_service_gpu_seconds_total", user=user) > 0,
                       what="service charged to the user")
        c.call(CancelRequest(job_ids=[waiting]), CancelResult)


def test_engine_hooks_show_up_as_counters(daemon_factory: Callable[..., DaemonHandle]) -> None:
    daemon: DaemonHandle = daemon_factory(metrics_address="127.0.0.1:0")
    assert daemon.daemon is not None
    metrics = daemon.daemon.engine.metrics
    metrics.record_xid(1, 48)
    metrics.record_xid(1, 48)
    metrics.record_mig_reconfiguration(0)
    metrics.observe_pass(0.002)
    samples = scrape(port_of(daemon))
    assert value(samples, "gpusched_xid_total", gpu="1", xid="48") == 2.0
    assert value(samples, "gpusched_mig_reconfigurations_total", gpu="0") == 1.0
    assert value(samples, "gpusched_scheduler_pass_seconds_bucket", le="0.0025") >= 1.0


def test_group_commits_count_the_fsyncs_and_the_submits_they_made_durable(
        daemon_factory: Callable[..., DaemonHandle]) -> None:
    daemon: DaemonHandle = daemon_factory(metrics_address="127.0.0.1:0")
    port = port_of(daemon)
    idle = scrape(port)
    assert value(idle, "gpusched_group_commits_total") == 0.0
    assert value(idle, "gpusched_group_commit_writes_total") == 0.0
    with daemon.client() as c:
        for _ in range(3):  # one at a time: each waits for its own COMMIT
            submit(c, "sleep", "30", gpus=2)
        spec = JobSpec(argv=["true"], cwd=os.getcwd(), env={"PATH": os.environ["PATH"]}, request=WholeRequest(gpus=1))
        made = c.call(SubmitRequest(spec=spec, array="1-5"), SubmitResult)  # one write, however many tasks
        assert made.tasks == 5
    after = scrape(port)
    assert value(after, "gpusched_group_commits_total") == 4.0
    assert value(after, "gpusched_group_commit_writes_total") == 4.0


def test_http_details(daemon_factory: Callable[..., DaemonHandle]) -> None:
    daemon: DaemonHandle = daemon_factory(metrics_address="127.0.0.1:0")
    port = port_of(daemon)
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/nope", timeout=10)
    assert err.value.code == 404
    err.value.close()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                 headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
        assert resp.read().decode().rstrip().endswith("# EOF")
    head = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", method="HEAD")
    with urllib.request.urlopen(head, timeout=10) as resp:
        assert resp.status == 200 and resp.read() == b""
    assert scrape(port, "/")  # the root answers too, for quick `curl host:port`


def test_daemon_refuses_to_start_on_a_busy_metrics_port(daemon_factory: Callable[..., DaemonHandle]) -> None:
    from gpusched.daemon.main import StartupError

    first: DaemonHandle = daemon_factory(metrics_address="127.0.0.1:0")
    with pytest.raises(StartupError, match=rf"metrics_address 127.0.0.1:{port_of(first)}: cannot listen"):
        daemon_factory(metrics_address=f"127.0.0.1:{port_of(first)}")


def test_remote_metrics_address_needs_an_explicit_opt_in(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "g.toml")
    with open(path, "w") as f:
        f.write('metrics_address = "0.0.0.0:9490"\n')
    with pytest.raises(ConfigError, match=r"g\.toml: invalid configuration: metrics_address: .*not a loopback "
                                          r"address.*metrics_allow_remote = true"):
        load_config(path, uid=0, env={})
    with open(path, "w") as f:
        f.write('metrics_allow_remote = true\nmetrics_address = "0.0.0.0:9490"\n')
    assert load_config(path, uid=0, env={}).metrics_address == "0.0.0.0:9490"
    for ok in ("127.0.0.1:9490", "[::1]:9490", "localhost:0"):
        assert load_config(None, {"metrics_address": ok}, uid=0, env={}).metrics_address == ok
    for bad, why in (("9490", "not HOST:PORT"), ("::1:9490", "in brackets"), ("127.0.0.1:70000", "out of range")):
        with pytest.raises(ConfigError, match=why):
            load_config(None, {"metrics_address": bad}, uid=0, env={})


def test_xid_counts_and_drains_show_up(daemon_factory: Callable[..., DaemonHandle]) -> None:
    daemon = daemon_factory(metrics_address="127.0.0.1:0")
    port = port_of(daemon)
    with daemon.client() as c:
        c.call(SimInjectXidRequest(gpu=1, xid=79), SimResult)  # GPU fell off the bus: drained
        samples = scrape_when(port, "gpusched_xid_total", 1.0, gpu="1", xid="79")
    assert value(samples, "gpusched_device_healthy", gpu="1") == 0.0
    assert value(samples, "gpusched_device_healthy", gpu="0") == 1.0


def test_mig_instances_are_devices_and_their_creation_is_counted(
        daemon_factory: Callable[..., DaemonHandle]) -> None:
    daemon = daemon_factory(sim="H100-80GB:1", metrics_address="127.0.0.1:0",
                            gpus={"0": {"mig": ["3g.40gb", "3g.40gb"]}})
    samples = scrape(port_of(daemon))
    devices = [dict(ls) for (n, ls) in samples if n == "gpusched_device_allocated"]
    assert [(d["gpu"], d["kind"], d["profile"]) for d in devices] == [("0", "mig", "3g.40gb")] * 2
    assert all(d["uuid"].startswith("MIG-") for d in devices)
    assert value(samples, "gpusched_mig_reconfigurations_total", gpu="0") == 2.0


_LIMITED_DAEMON = ("import resource, sys\n"
                   "resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv.pop(1)),) * 2)\n"
                   "from gpusched.daemon.main import cli\n"
                   "cli()\n")


def test_a_connection_flood_on_metrics_leaves_the_control_socket_working(tmp_path: object) -> None:
    """With the daemon limited to 256 files, 600 idle connections to /metrics used to take every
    descriptor, and other users' `submit` failed. The endpoint has its own, much smaller, cap."""
    import re
    import resource
    import shutil
    import socket
    import subprocess
    import sys

    from gpusched.protocol import QueueRequest, QueueResult
    from tests.conftest import short_tmpdir

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 1024:
        pytest.skip("the test needs 1024 descriptors of its own")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1024), hard))
    base = short_tmpdir()
    sock_path, log_path = os.path.join(base, "g.sock"), os.path.join(base, "daemon.log")
    config = os.path.join(base, "gpusched.toml")
    with open(config, "w") as f:
        f.write('allow_root_jobs = true\ncgroup_root = "off"\ntick_s = 0.2\nmetrics_address = "127.0.0.1:0"\n'
                "metrics_max_connections = 8\n")
    with open(log_path, "wb") as log:
        daemon = subprocess.Popen([sys.executable, "-c", _LIMITED_DAEMON, "256", "--config", config, "--sim",
                                   "H100-80GB:1", "--socket", sock_path, "--state-dir", os.path.join(base, "state")],
                                  stdout=log, stderr=log, start_new_session=True)
    flood: list[socket.socket] = []
    try:
        def port() -> int:
            with open(log_path) as f:
                text = f.read()
            assert daemon.poll() is None, text
            found = re.search(r"serving Prometheus metrics on http://127\.0\.0\.1:(\d+)/", text)
            return int(found.group(1)) if found else 0

        metrics_port = wait_until(port, timeout=30, what="the metrics endpoint")
        wait_until(lambda: os.path.exists(sock_path), timeout=30, what="the control socket")
        for _ in range(600):
            s = socket.create_connection(("127.0.0.1", metrics_port), timeout=5)
            flood.append(s)
        with Client(sock_path, timeout=10) as c:  # the control socket still accepts, the database still opens
            job_id = c.call(SubmitRequest(spec=JobSpec(argv=["true"], cwd="/tmp", request=WholeRequest(gpus=1)),
                                          hold=True), SubmitResult).job_id
            assert [j.id for j in c.call(QueueRequest(), QueueResult).jobs] == [job_id]
        for s in flood:
            s.close()
        flood.clear()
        assert wait_until(lambda: _scrape_or_none(metrics_port), timeout=30, what="a scrape after the flood")
    finally:
        for s in flood:
            s.close()
        daemon.terminate()
        daemon.wait(30)
        shutil.rmtree(base, ignore_errors=True)


def _scrape_or_none(port: int) -> Samples | None:
    try:
        return scrape(port)
    except (OSError, urllib.error.URLError):
        return None


def test_a_lost_gpu_keeps_a_device_healthy_series_at_0(daemon_factory: Callable[..., DaemonHandle]) -> None:
    """A GPU that fell off the bus lost its series: `gpusched_device_healthy == 0` never fired."""
    daemon = daemon_factory(metrics_address="127.0.0.1:0")
    port = port_of(daemon)
    uuid1 = {dict(ls)["gpu"]: dict(ls)["uuid"] for (n, ls), _ in scrape(port).items()
             if n == "gpusched_device_healthy"}["1"]
    with daemon.client() as c:
        c.call(SimInjectXidRequest(gpu=1, xid=79, lost=True), SimResult)
    samples = scrape_when(port, "gpusched_xid_total", 1.0, gpu="1", xid="79")
    healthy = {dict(ls)["gpu"]: (dict(ls)["uuid"], v) for (n, ls), v in samples.items()
               if n == "gpusched_device_healthy"}
    assert healthy["1"] == (uuid1, 0.0) and healthy["0"][1] == 1.0, healthy
