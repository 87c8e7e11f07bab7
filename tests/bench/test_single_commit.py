"""bench/single_commit_daemon.py, bench_api's baseline for group commit's gain, is what it says: the
real daemon, answering every submit, with each submit's write committed alone. A baseline that still
batched would hide the gain it is there to show."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest

from gpusched.protocol import SubmitRequest
from gpusched.wire import encode_frame
from gpusched_cli.client import Client

_FRAME = encode_frame(SubmitRequest.model_validate(
    {"spec": {"argv": ["true"], "cwd": "/tmp", "env": {"A": "1"}, "request": {"kind": "whole", "gpus": 1}}},
).model_dump(mode="json"))


@pytest.mark.timeout(90)
def test_every_submit_is_committed_alone(bench_module: Callable[[str], ModuleType]) -> None:
    h = bench_module("harness")
    d = h.DaemonProc(h.short_tmpdir("gbt1-"), extra_config=h.METRICS, program=h.SINGLE_COMMIT)
    try:
        d.start()
        with Client(d.socket) as c:
            for gpu in range(8):  # nothing starts: the jobs stay PENDING
                c.request({"op": "gpu_drain", "device": str(gpu), "reason": "test"})
        commits = d.metrics_counter("gpusched_group_commits_total")
        writes = d.metrics_counter("gpusched_group_commit_writes_total")
        # Eight clients with a submit in flight each: gpuschedd's own group commit batches them.
        _, ids = h.send_submits_concurrently(d.socket, lambda: _FRAME, 40, 8)
        assert len(set(ids)) == 40
        assert d.metrics_counter("gpusched_group_commit_writes_total") - writes == 40
        assert d.metrics_counter("gpusched_group_commits_total") - commits == 40
        with Client(d.socket) as c:
            assert c.request({"op": "show", "job_id": ids[-1]})["job"]["state"] == "PENDING"
    finally:
        d.cleanup()
