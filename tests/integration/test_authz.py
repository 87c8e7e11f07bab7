"""Authorization matrix: every request type x {job owner, another user, admin (root)}.

Each cell is either *allowed* (`ok: true` and the effect is visible afterwards) or *refused* with
`permission_denied` and a message that says who may do it (and the state is unchanged): never a
silent no-op. The request types are read from `protocol.REQUEST_ADAPTER`'s union, so adding a
request without deciding its row here fails `test_every_request_type_has_a_row`.

Clients run in child processes that drop to uid 12345 (the owner) or 12346 (another user) before
connecting, so the daemon learns who they are from SO_PEERCRED exactly as it would for real users.
Needs root (CI runs as root).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import typing
from collections.abc import Callable
from typing import Any

import pytest

from gpusched import protocol
from gpusched.model import JobSpec, JobState, WholeRequest
from gpusched.protocol import PROTOCOL_VERSION, GpusRequest, GpusResult, ShowRequest, ShowResult
from gpusched_cli.client import Client
from tests.conftest import DaemonHandle, wait_until
from tests.integration.test_identity import as_user

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch uids")

OWNER, OTHER, ADMIN = 12345, 12346, 0
ROLES = {"owner": OWNER, "other": OTHER, "admin": ADMIN}
SECRET = "s3cr3t-value"

ALLOW, DENY = "allow", "deny"
# Passes the authorization check, but the in-process test daemon cannot carry it out (reload: it was
# started without a config file): any answer except permission_denied.
ADMIT = "admit"
# op -> (owner, other, admin). "owner" is the user whose jobs the request targets (for requests that
# name no job it is simply an ordinary user, like "other"). Admin = root (or admin_group, or the
# daemon's own uid). Submit by root is allowed here because the test daemon has allow_root_jobs.
EXPECTED: dict[str, tuple[str, str, str]] = {
    "hello": (ALLOW, ALLOW, ALLOW),
    "submit": (ALLOW, ALLOW, ALLOW),
    "queue": (ALLOW, ALLOW, ALLOW),  # anyone sees that jobs exist (no environments in a queue row)
    "show": (ALLOW, ALLOW, ALLOW),  # ... and their details, but a non-owner gets the env redacted
    "wait": (ALLOW, ALLOW, ALLOW),  # same redaction as show
    "gpus": (ALLOW, ALLOW, ALLOW),
    "watch": (ALLOW, ALLOW, ALLOW),  # `gpusched top`: the same public view as queue and gpus
    "stats": (ALLOW, ALLOW, ALLOW),  # per-user usage and fairness figures are public on the node
    "doctor": (ALLOW, ALLOW, ALLOW),  # other users' pids and command lines are redacted for non-admins
    "cancel": (ALLOW, DENY, ALLOW),
    "logs": (ALLOW, DENY, ALLOW),
    "suspend": (ALLOW, DENY, ALLOW),
    "resume": (ALLOW, DENY, ALLOW),
    "hold": (ALLOW, DENY, ALLOW),
    "release": (ALLOW, DENY, ALLOW),
    "gpu_drain": (DENY, DENY, ALLOW),
    "gpu_resume": (DENY, DENY, ALLOW),
    "mig_apply": (DENY, DENY, ALLOW),
    "sim_inject_xid": (DENY, DENY, ALLOW),
    "reload": (DENY, DENY, ADMIT),
    "shutdown": (DENY, DENY, ALLOW),
}


def request_ops() -> set[str]:
    """Every `op` in the protocol's request union (Annotated[A | B | ..., Field(discriminator)])."""
    union = typing.get_args(protocol.Request)[0]
    return {model.model_fields["op"].default for model in typing.get_args(union)}


def test_every_request_type_has_a_row() -> None:
    ops = request_ops()
    missing, stale = ops - EXPECTED.keys(), EXPECTED.keys() - ops
    assert not missing, f"request types without an authorization row in EXPECTED: {sorted(missing)}"
    assert not stale, f"rows for request types the protocol no longer has: {sorted(stale)}"


# ---- clients as other users ----------------------------------------------------------------------

# Runs in a child: import while still root, drop to uid/gid, then send each message on a connection
# of its own (after the client's own hello; a streaming request such as `watch` answers with its
# first frame and is then hung up on) and print every first reply; a connection closed without an
# answer is reported as {"closed": true} rather than a traceback.
_AS_USER = """
import json, os, sys
from gpusched_cli.client import Client, DaemonUnavailable
uid, path = int(sys.argv[1]), sys.argv[2]
messages = json.load(sys.stdin)
if uid != 0:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
replies = []
for m in messages:
    try:
        with Client(path, timeout=20) as c:
            replies.append(c.raw_call(m))
    except (DaemonUnavailable, OSError):
        replies.append({"closed": True})
print(json.dumps(replies))
"""


def as_uid(uid: int, socket_path: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = subprocess.run([sys.executable, "-c", _AS_USER, str(uid), socket_path],
                         input=json.dumps(messages), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    replies = list(json.loads(out.stdout))
    assert len(replies) == len(messages), replies
    return replies


def spec_message(*argv: str, hold: bool = False, name: str = "") -> dict[str, Any]:
    spec = JobSpec(argv=list(argv), cwd="/tmp", env={"PATH": "/usr/bin:/bin", "SECRET": SECRET},
                   request=WholeRequest(gpus=1), name=name or None)
    return {"op": "submit", "spec": spec.model_dump(mode="json"), "hold": hold}


def job(d: DaemonHandle, job_id: int) -> Any:
    with d.client() as c:
        return c.call(ShowRequest(job_id=job_id), ShowResult).job


def state(d: DaemonHandle, job_id: int) -> JobState:
    return JobState(job(d, job_id).state)


# ---- the matrix ----------------------------------------------------------------------------------


def test_authorization_matrix(daemon_factory: Callable[..., DaemonHandle]) -> None:
    # Seven whole GPUs for running jobs; GPU 7 is in MIG mode so mig_apply / XIDs have a target
    # that no job uses.
    d = daemon_factory(sim="H100-80GB:8", gpus={"7": {"mig": ["1g.10gb"]}})
    ops = request_ops()
    assert ops <= EXPECTED.keys(), "see test_every_request_type_has_a_row"

    # Jobs owned by OWNER: one running job every role reads (show/logs/wait), one running job per
    # role to suspend, one suspended job per role to resume; then (all whole GPUs busy) a pending
    # job per role to cancel and to hold, and a held job per role to release.
    running = as_uid(OWNER, d.socket, [spec_message("sh", "-c", "echo hello-log; sleep 60", name="reader")]
                     + [spec_message("sleep", "60", name=f"run{i}") for i in range(6)])
    assert all(r["ok"] for r in running), running
    reader, *runners = [r["result"]["job_id"] for r in running]
    suspend_t = dict(zip(ROLES, runners[:3], strict=True))
    resume_t = dict(zip(ROLES, runners[3:], strict=True))
    wait_until(lambda: all(state(d, j) is JobState.RUNNING for j in [reader, *runners]), what="jobs running")
    queued = as_uid(OWNER, d.socket, [{"op": "suspend", "job_ids": list(resume_t.values())}]
                    + [spec_message("true", name=f"cancel-{r}") for r in ROLES]
                    + [spec_message("true", name=f"hold-{r}") for r in ROLES]
                    + [spec_message("true", hold=True, name=f"release-{r}") for r in ROLES])
    assert all(r["ok"] for r in queued), queued
    assert queued[0]["result"]["changed"] == sorted(resume_t.values())
    ids = [r["result"]["job_id"] for r in queued[1:]]
    cancel_t, hold_t, release_t = (dict(zip(ROLES, ids[i:i + 3], strict=True)) for i in (0, 3, 6))
    for job_id in [*cancel_t.values(), *hold_t.values()]:
        assert state(d, job_id) is JobState.PENDING
    with d.client() as root:
        wait_until(lambda: "hello-log" in root.raw_call({"op": "logs", "job_id": reader})["result"]["data"],
                   what="reader's log")
    with d.client() as root:  # a drained device for gpu_resume to bring back
        root.raw_call({"op": "gpu_drain", "device": "5"})

    def messages(role: str) -> dict[str, dict[str, Any]]:
        return {
            "hello": {"op": "hello", "version": PROTOCOL_VERSION, "client": "authz"},
            "submit": spec_message("true", hold=True, name=f"by-{role}"),
            "queue": {"op": "queue"},
            "show": {"op": "show", "job_id": reader},
            "wait": {"op": "wait", "job_id": reader, "timeout_s": 0},
            "gpus": {"op": "gpus"},
            "watch": {"op": "watch"},
            "stats": {"op": "stats"},
            "doctor": {"op": "doctor"},
            "cancel": {"op": "cancel", "job_ids": [cancel_t[role]]},
            "logs": {"op": "logs", "job_id": reader},
            "suspend": {"op": "suspend", "job_ids": [suspend_t[role]]},
            "resume": {"op": "resume", "job_ids": [resume_t[role]]},
            "hold": {"op": "hold", "job_ids": [hold_t[role]]},
            "release": {"op": "release", "job_ids": [release_t[role]]},
            "gpu_drain": {"op": "gpu_drain", "device": "6" if role == "admin" else "0", "reason": "authz"},
            "gpu_resume": {"op": "gpu_resume", "device": "5"},
            "mig_apply": {"op": "mig_apply", "gpu": 7, "layout": ["1g.10gb"], "dry_run": True},
            "sim_inject_xid": {"op": "sim_inject_xid", "gpu": 7, "xid": 43},
            "reload": {"op": "reload"},
            "shutdown": {"op": "shutdown"},
        }

    replies: dict[str, dict[str, dict[str, Any]]] = {}
    for role, uid in ROLES.items():
        # The admin's shutdown is sent last of all, once everything else has been checked.
        sent = {op: m for op, m in messages(role).items() if op in ops and not (role == "admin" and op == "shutdown")}
        replies[role] = dict(zip(sent, as_uid(uid, d.socket, list(sent.values())), strict=True))

    failures: list[str] = []
    for op in sorted(ops):
        for column, role in enumerate(ROLES):
            if role == "admin" and op == "shutdown":
                continue
            reply = replies[role][op]
            expected = EXPECTED[op][column]
            if expected == ALLOW and reply.get("ok") is not True:
                failures.append(f"{op} by {role}: expected allowed, got {reply}")
            elif expected == ADMIT and (reply.get("error") or {}).get("code") in ("permission_denied", None) \
                    and reply.get("ok") is not True:
                failures.append(f"{op} by {role}: expected to pass the authorization check, got {reply}")
            elif expected == DENY:
                err = reply.get("error") or {}
                if reply.get("ok") is not False or err.get("code") != "permission_denied":
                    failures.append(f"{op} by {role}: expected permission_denied, got {reply}")
                elif not err.get("message") or not err.get("hint"):
                    failures.append(f"{op} by {role}: refusal without a message and hint: {err}")
    assert not failures, "\n".join(failures)

    # ---- allowed means it happened; refused means nothing changed -----------------------------
    for role, uid in ROLES.items():
        r = replies[role]
        assert r["hello"]["result"]["uid"] == uid
        assert r["hello"]["result"]["admin"] is (role == "admin")
        submitted = job(d, r["submit"]["result"]["job_id"])
        assert (submitted.uid, submitted.state) == (uid, JobState.HELD)  # the kernel's uid, not the payload's
        assert reader in [row["id"] for row in r["queue"]["result"]["jobs"]]
        for op in ("show", "wait"):
            env = r[op]["result"]["job"]["spec"]["env"]
            assert env == ({} if role == "other" else {"PATH": "/usr/bin:/bin", "SECRET": SECRET}), (op, role)
        assert len(r["gpus"]["result"]["gpus"]) == 8

        denied = EXPECTED["cancel"][list(ROLES).index(role)] == DENY
        for op, target, before, after in (
            ("cancel", cancel_t, JobState.PENDING, JobState.CANCELLED),
            ("suspend", suspend_t, JobState.RUNNING, JobState.SUSPENDED),
            ("resume", resume_t, JobState.SUSPENDED, JobState.RUNNING),
            ("hold", hold_t, JobState.PENDING, JobState.HELD),
            ("release", release_t, JobState.HELD, JobState.PENDING),
        ):
            job_id = target[role]
            if denied:
                message = r[op]["error"]["message"]
                assert str(job_id) in message and f"belongs to {OWNER}" in message, message
                assert state(d, job_id) is before, f"{op} by {role} was refused but job {job_id} changed"
            else:
                result = r[op]["result"]
                assert job_id in result.get("changed", result.get("cancelled", [])), (op, role, result)
                assert state(d, job_id) is after, (op, role)
        if denied:
            assert r["logs"]["error"]["message"].startswith(f"job {reader} belongs to {OWNER}")
        else:
            assert r["logs"]["result"]["data"].startswith("hello-log")

    admin = replies["admin"]
    assert admin["gpu_drain"]["result"]["devices"]
    assert admin["gpu_resume"]["result"]["devices"]  # still drained: owner's and other's resume did nothing
    assert admin["mig_apply"]["result"]["applied"] is False
    assert "XID 43" in admin["sim_inject_xid"]["result"]["message"]
    with d.client() as root:
        health = {g.index: g.health for g in root.call(GpusRequest(), GpusResult).gpus}
    assert health[0] == "ok", "a refused gpu_drain drained GPU 0"
    assert health[5] == "ok" and health[6] != "ok"

    # Refused shutdowns left the daemon serving; the admin's stops it.
    with d.client() as root:
        assert root.raw_call({"op": "queue"})["ok"] is True
    [stop] = as_uid(ADMIN, d.socket, [{"op": "shutdown"}])
    assert stop == {"ok": True, "result": {"stopping": True}}
    wait_until(lambda: not os.path.exists(d.socket), what="daemon stopped after admin shutdown")


def test_batch_with_one_foreign_job_is_refused_whole(daemon: DaemonHandle) -> None:
    """All or nothing: a list naming someone else's job changes none of the caller's own jobs."""
    [theirs] = as_uid(OWNER, daemon.socket, [spec_message("true", hold=True)])
    mine = as_uid(OTHER, daemon.socket, [spec_message("true", hold=True)])[0]["result"]["job_id"]
    their_id = theirs["result"]["job_id"]
    for op in ("cancel", "release"):
        [reply] = as_uid(OTHER, daemon.socket, [{"op": op, "job_ids": [mine, their_id]}])
        assert reply["error"]["code"] == "permission_denied", reply
        assert state(daemon, mine) is JobState.HELD and state(daemon, their_id) is JobState.HELD


def test_identity_cannot_be_claimed_in_the_payload(daemon: DaemonHandle) -> None:
    """Fields that would name a user are not part of any request: they are refused, not ignored."""
    forged = spec_message("true", hold=True)
    replies = as_uid(OTHER, daemon.socket, [
        {**forged, "uid": 0},
        {**forged, "spec": {**forged["spec"], "uid": 0, "user": "root"}},
        {"op": "hello", "version": PROTOCOL_VERSION, "uid": 0},
        {"op": "queue", "as_user": "root"},
    ])
    for reply in replies:
        assert reply["ok"] is False and reply["error"]["code"] == "bad_request", reply
    with daemon.client() as root:
        assert root.raw_call({"op": "queue", "all": True})["result"]["jobs"] == []


def test_a_users_job_runs_without_root_privileges(daemon: DaemonHandle) -> None:
    """Privileges are dropped before chdir and exec: root-only paths stay closed to the job."""
    private = tempfile.mkdtemp(prefix="gs-root-only-", dir="/tmp")  # 0700, owned by root
    try:
        [bad_cwd, reads_root] = as_uid(OWNER, daemon.socket, [
            {**spec_message("true"), "spec": {**spec_message("true")["spec"], "cwd": private}},
            spec_message("sh", "-c", "id -u; id -G; cat /etc/shadow >/dev/null && echo READ-SHADOW; exit 0"),
        ])
        wait_until(lambda: state(daemon, bad_cwd["result"]["job_id"]) is JobState.FAILED, what="cwd refused")
    finally:
        os.rmdir(private)
    assert f"chdir {private}: Permission denied" in job(daemon, bad_cwd["result"]["job_id"]).reason
    job_id = reads_root["result"]["job_id"]
    wait_until(lambda: state(daemon, job_id) is JobState.COMPLETED, what="job done")
    with daemon.client() as root:
        out = root.raw_call({"op": "logs", "job_id": job_id})["result"]["data"]
    lines = out.splitlines()
    assert lines[0] == str(OWNER) and lines[1] == str(OWNER), out  # uid and the only group: no root gid
    assert "READ-SHADOW" not in out


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch uids")
def test_per_user_pending_and_rate_limits(daemon_factory: Any) -> None:
    """One user cannot fill the queue or flood the database; root stays exempt."""
    d = daemon_factory(max_pending_per_user=3)
    spec = {"argv": ["true"], "cwd": "/tmp", "env": {}, "request": {"kind": "whole", "gpus": 2}}
    blocker = as_user(12345, d.socket, {"op": "submit", "spec": {**spec, "argv": ["sleep", "30"]}})[0]
    assert blocker["ok"], blocker
    replies = as_user(12345, d.socket, *[{"op": "submit", "spec": spec} for _ in range(4)])
    codes = [r["error"]["code"] if not r["ok"] else "ok" for r in replies]
    assert codes[:3] == ["ok", "ok", "ok"] and codes[3] == "limit_exceeded"
    assert "max_pending_per_user = 3" in replies[3]["error"]["message"]
    with Client(d.socket) as root:  # root is exempt from both limits
        for _ in range(5):
            assert root.raw_call({"op": "submit", "spec": spec})["ok"]
    fast = daemon_factory(submit_rate_per_user=1.0)
    burst = as_user(12346, fast.socket, *[{"op": "submit", "spec": spec} for _ in range(12)])
    limited = [r for r in burst if not r["ok"]]
    assert limited and all(r["error"]["code"] == "limit_exceeded" for r in limited)
    assert any("submit_rate_per_user" in r["error"]["message"] for r in limited)
