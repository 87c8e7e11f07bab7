"""Identity from SO_PEERCRED: jobs run as their submitter, and only owners (or admins) act on them.

These tests need root (CI runs as root): a client process drops to another uid before it connects,
so the daemon sees that uid from the kernel, exactly as it would for a real user.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from gpusched.model import JobSpec, JobState, WholeRequest
from gpusched.protocol import (
    PROTOCOL_VERSION,
    CancelRequest,
    CancelResult,
    LogsRequest,
    LogsResult,
    ShowRequest,
    ShowResult,
)
from tests.conftest import DaemonHandle, wait_until

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch uids")

# Runs in a child process: import everything while still root (the interpreter lives under
# /root), drop to the given uid/gid, then talk to the daemon and print the replies as JSON.
_AS_USER = """
import json, os, sys
from gpusched_cli.client import Client
from gpusched.protocol import encode_frame, decode_body
uid, gid, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
messages = json.load(sys.stdin)
os.setgroups([])
os.setgid(gid)
os.setuid(uid)
replies = []
with Client(path) as c:
    for m in messages:
        replies.append(c.raw_call(m))
print(json.dumps(replies))
"""


def as_user(uid: int, socket_path: str, *messages: dict[str, Any]) -> list[dict[str, Any]]:
    out = subprocess.run(
        [sys.executable, "-c", _AS_USER, str(uid), str(uid), socket_path],
        input=json.dumps(list(messages)), capture_output=True, text=True, timeout=30,
    )
    assert out.returncode == 0, out.stderr
    return list(json.loads(out.stdout))


def submit_message(*argv: str) -> dict[str, Any]:
    spec = JobSpec(argv=list(argv), cwd="/tmp", env={"PATH": "/usr/bin:/bin"}, request=WholeRequest(gpus=1))
    return {"op": "submit", "spec": spec.model_dump(mode="json")}


def test_job_runs_as_submitter_and_only_owner_or_root_may_touch_it(daemon: DaemonHandle) -> None:
    [reply] = as_user(12345, daemon.socket, submit_message("sh", "-c", "id -u; id -g; sleep 30"))
    assert reply["ok"], reply
    job_id = reply["result"]["job_id"]
    with daemon.client() as root:
        wait_until(lambda: root.call(LogsRequest(job_id=job_id), LogsResult).data == "12345\n12345\n",
                   what="job output")
        job = root.call(ShowRequest(job_id=job_id), ShowResult).job
        assert (job.uid, job.user, job.state) == (12345, "12345", JobState.RUNNING)
        assert os.stat(root.call(ShowRequest(job_id=job_id), ShowResult).log_path or "").st_uid == 12345

    show, cancel, logs = as_user(
        12346, daemon.socket, {"op": "show", "job_id": job_id}, {"op": "cancel", "job_ids": [job_id]},
        {"op": "logs", "job_id": job_id},
    )
    assert show["ok"] and show["result"]["job"]["spec"]["env"] == {}  # visible, but not its environment
    assert cancel["error"]["code"] == "permission_denied"
    assert "belongs to 12345" in cancel["error"]["message"]
    assert logs["error"]["code"] == "permission_denied"

    [own_logs] = as_user(12345, daemon.socket, {"op": "logs", "job_id": job_id})
    assert own_logs["result"]["data"] == "12345\n12345\n"

    with daemon.client() as root:
        assert root.call(CancelRequest(job_ids=[job_id]), CancelResult).cancelled == [job_id]
        wait_until(lambda: root.call(ShowRequest(job_id=job_id), ShowResult).job.state is JobState.CANCELLED,
                   what="cancelled")
        assert "by root" in root.call(ShowRequest(job_id=job_id), ShowResult).job.reason


def test_root_jobs_are_refused_unless_allowed(daemon_factory: Any) -> None:
    strict = daemon_factory(allow_root_jobs=False)
    with strict.client() as root:
        reply = root.raw_call(submit_message("true"))
    assert reply["error"]["code"] == "permission_denied"
    assert "allow_root_jobs" in reply["error"]["hint"]


def test_hello_reports_identity_from_the_kernel(daemon: DaemonHandle) -> None:
    [hello] = as_user(12345, daemon.socket, {"op": "hello", "version": PROTOCOL_VERSION, "client": "test"})
    assert hello["result"]["uid"] == 12345
    assert hello["result"]["admin"] is False
