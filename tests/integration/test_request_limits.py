"""Requests cannot exhaust the daemon: spec sizes in bytes, finished jobs pruned, cheap refusals,
bounded listings, escaped output, and a deadline on every read.

Each test is the reproduction of a finding from the adversarial review of hardening round 2.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from gpusched.daemon.store import StoreReader
from gpusched.model import MAX_DISPLAY_NAME, MAX_SPEC_BYTES, Dependency, JobSpec, JobState, WholeRequest, spec_bytes
from gpusched.protocol import (
    MAX_FRAME,
    PROTOCOL_VERSION,
    CancelRequest,
    CancelResult,
    QueueRequest,
    QueueResult,
    ShowRequest,
    ShowResult,
    StatsRequest,
    StatsResult,
    SubmitRequest,
    SubmitResult,
    decode_body,
    encode_frame,
)
from gpusched.submittable import MAX_ARG_STRLEN
from gpusched_cli.main import cli
from tests.conftest import DaemonHandle, wait_until
from tests.integration.test_identity import as_user

OTHER_UID = 23456


def _spec(*argv: str, **kw: Any) -> JobSpec:
    fields: dict[str, Any] = {"env": {"PATH": "/usr/bin:/bin"}, **kw}
    return JobSpec(argv=list(argv), cwd="/tmp", request=WholeRequest(gpus=1), **fields)


def _submit(c: Any, spec: JobSpec, hold: bool = True) -> int:
    return int(c.call(SubmitRequest(spec=spec, hold=hold), SubmitResult).job_id)


def _prune(handle: DaemonHandle) -> int:
    assert handle.daemon is not None and handle.loop is not None
    return asyncio.run_coroutine_threadsafe(handle.daemon.prune(), handle.loop).result(30)


# ---- item 3: spec sizes and finished jobs -----------------------------------------------------------


@pytest.mark.parametrize("what, spec", [
    ("four-byte characters", {"argv": ["true", "\U0001F600" * (MAX_SPEC_BYTES // 4)]}),
    ("a long cwd", {"argv": ["true"], "cwd": "/" + "a" * MAX_SPEC_BYTES}),
    ("many empty arguments", {"argv": ["true", *[""] * (MAX_SPEC_BYTES // 8)]}),
    ("a long name", {"argv": ["true"], "env": {"X": "y" * (MAX_SPEC_BYTES - 60)}, "name": "n" * 128}),
])
def test_the_spec_cap_counts_bytes_of_everything(what: str, spec: dict[str, Any]) -> None:
    """255k astral characters were 1 MB under a cap of 256k *characters*; cwd and name were not counted."""
    data = {"cwd": "/tmp", "request": {"kind": "whole", "gpus": 1}, **spec}
    with pytest.raises(ValidationError, match=f"at most {MAX_SPEC_BYTES} are accepted"):
        JobSpec.model_validate(data)
    small = JobSpec.model_validate({**data, "argv": ["true"], "cwd": "/tmp", "env": {}, "name": None})
    assert spec_bytes(small) == 2 * 9 + len("true") + len("/tmp")  # each string: its bytes + NUL + pointer


def test_an_oversized_spec_is_refused_on_the_wire(daemon: DaemonHandle) -> None:
    spec = {"argv": ["true", "\U0001F600" * 70_000], "cwd": "/tmp", "request": {"kind": "whole", "gpus": 1}}
    with daemon.client() as c:
        reply = c.raw_call({"op": "submit", "spec": spec})
    assert reply["ok"] is False and reply["error"]["code"] == "bad_request"
    assert "280" in reply["error"]["message"] and "bytes" in reply["error"]["message"]


def test_finished_jobs_are_pruned_by_count_and_age_but_dependencies_are_kept(
        daemon_factory: Callable[..., DaemonHandle]) -> None:
    """Submit-and-cancel used to grow the database for ever; now only the newest max_finished_jobs stay."""
    handle = daemon_factory(max_finished_jobs=2)
    with handle.client() as c:
        ran = _submit(c, _spec("sh", "-c", "echo hi"), hold=False)
        wait_until(lambda: c.call(ShowRequest(job_id=ran), ShowResult).job.state is JobState.COMPLETED, what="ran")
        log_path = c.call(ShowRequest(job_id=ran), ShowResult).log_path
        assert log_path and os.path.exists(log_path)
        ids = [_submit(c, _spec("true")) for _ in range(5)]
        c.call(CancelRequest(job_ids=ids), CancelResult)
        assert _prune(handle) == 4  # `ran` and the three oldest cancelled jobs
        listed = c.call(QueueRequest(all=True), QueueResult)
        assert [j.id for j in listed.jobs] == ids[-2:]
        assert c.raw_call({"op": "show", "job_id": ran})["error"]["code"] == "not_found"
        assert not os.path.exists(log_path)
        assert not os.path.exists(os.path.join(handle.state_dir, "jobs", str(ran)))
        c.call(StatsRequest(since_s=3600), StatsResult)  # works over what is kept

        # A finished job that a held job waits for (--after) is kept whatever the limits say.
        target = ids[-1]
        waiter = _submit(c, _spec("true", after=[Dependency(job_id=target, condition="any")]))
        assert handle.daemon is not None
        handle.daemon.config = handle.daemon.config.model_copy(update={"max_finished_jobs": 0,
                                                                        "finished_job_retention_s": 0.0})
        assert _prune(handle) == 1
        assert [j.id for j in c.call(QueueRequest(all=True), QueueResult).jobs] == [target, waiter]


def test_a_prune_works_its_cutoff_out_once_for_all_its_batches(daemon_factory: Callable[..., DaemonHandle]) -> None:
    """The cutoff walks `max_finished_jobs` entries (~30 ms at the default 10,000, here); worked out again
    for every batch of 500, it stalled the loop for seconds after a big array was cancelled."""
    handle = daemon_factory(max_finished_jobs=0)
    with handle.client() as c:
        array = c.call(SubmitRequest(spec=_spec("true"), hold=True, array="1-1200"), SubmitResult).job_id
        c.call(CancelRequest(job_ids=[array]), CancelResult)
    assert handle.daemon is not None
    statements: list[str] = []
    db = handle.daemon.store._db  # the daemon's own connection, used on its loop
    handle.call_in_loop(lambda: db.set_trace_callback(statements.append))
    try:
        assert _prune(handle) == 1200  # three batches
    finally:
        handle.call_in_loop(lambda: db.set_trace_callback(None))
    assert sum(1 for sql in statements if "OFFSET" in sql) == 1


def test_one_users_pending_jobs_are_capped_in_bytes(daemon_factory: Callable[..., DaemonHandle]) -> None:
    """50,000 pending jobs of ~1 MiB of heap each (bench/spec_memory.py) would be ~50 GiB: the bytes a
    user's waiting jobs take are capped too (max_pending_bytes_per_user); root is exempt."""
    spec = _spec("true", env={"PATH": "/usr/bin:/bin", "BIG": "x" * 100_000})
    size = spec_bytes(spec)
    handle = daemon_factory(max_pending_bytes_per_user=3 * size)
    message = {"op": "submit", "spec": spec.model_dump(mode="json"), "hold": True}
    replies = as_user(OTHER_UID, handle.socket, *[message] * 4)
    assert [r["ok"] for r in replies] == [True, True, True, False]
    assert replies[3]["error"]["code"] == "limit_exceeded"
    assert f"max_pending_bytes_per_user = {3 * size}" in replies[3]["error"]["message"]
    with handle.client() as root:
        root.call(CancelRequest(job_ids=[replies[0]["result"]["job_id"]]), CancelResult)  # frees its bytes
        assert root.raw_call(message)["ok"]  # root is exempt
    assert as_user(OTHER_UID, handle.socket, message)[0]["ok"]
    handle.restart()  # the count is rebuilt from the store on start
    assert as_user(OTHER_UID, handle.socket, message)[0]["error"]["code"] == "limit_exceeded"


def test_a_restart_sums_the_waiting_counts_in_sql_to_what_the_engine_counted(
        daemon_factory: Callable[..., DaemonHandle]) -> None:
    """The restart reads each user's waiting jobs and bytes from jobs.spec_bytes; they must be what
    the engine counted while it ran, and what it takes off again as the jobs leave, to the byte."""
    handle = daemon_factory(sim="H100-80GB:1")
    big = _spec("true", env={"BIG": "y" * 5_000})
    messages = [{"op": "submit", "spec": _spec("true", str(i)).model_dump(mode="json"), "hold": i % 2 == 0}
                for i in range(3)]
    messages += [{"op": "submit", "spec": big.model_dump(mode="json"), "array": "1-7%2"},
                 {"op": "submit", "spec": _spec("sleep", "60").model_dump(mode="json"), "array": "0-2", "hold": True}]
    with handle.client() as root:
        blocker = _submit(root, _spec("sleep", "60"), hold=False)  # RUNNING (so the others wait): not counted
        wait_until(lambda: root.call(ShowRequest(job_id=blocker), ShowResult).job.state is JobState.RUNNING,
                   what="the blocker running")
        _submit(root, big)
    assert all(r["ok"] for r in as_user(OTHER_UID, handle.socket, *messages))

    def counts() -> tuple[dict[int, int], dict[int, int]]:
        assert handle.daemon is not None
        engine = handle.daemon.engine
        return handle.call_in_loop(lambda: (dict(engine._waiting_by_uid), dict(engine._waiting_bytes_by_uid)))

    before = counts()
    assert before[0] == {OTHER_UID: 3 + 7 + 3, 0: 1}
    handle.restart()
    assert counts() == before
    with handle.client() as root:
        ids = [r.id for r in root.call(QueueRequest(array_tasks=True), QueueResult).jobs]
        root.call(CancelRequest(job_ids=ids), CancelResult)
    assert counts() == ({}, {})  # every job taken off exactly what the restart put on


# ---- item 4: cheap refusals, deduplicated ids, reads off the loop -----------------------------------


def test_permission_is_checked_before_any_spec_is_loaded_and_ids_are_deduplicated(daemon: DaemonHandle) -> None:
    """10,000 copies of another user's finished 1 MB job stalled everyone for 87 s before `permission_denied`."""
    # near the spec limit, in variables execve takes (each under MAX_ARG_STRLEN)
    big = _spec("true", env={"PATH": "/usr/bin:/bin", **{f"BIG{i}": "x" * 100_000 for i in range(2)},
                             "BIG2": "x" * (MAX_SPEC_BYTES - 200_300)})
    [reply] = as_user(OTHER_UID, daemon.socket, {"op": "submit", "spec": big.model_dump(mode="json"), "hold": True})
    theirs = reply["result"]["job_id"]
    with daemon.client() as c:
        c.call(CancelRequest(job_ids=[theirs]), CancelResult)  # root may; now it is finished, only in the store
    assert daemon.daemon is not None
    store = daemon.daemon.engine.store
    loads: list[str] = []
    original = store._select

    def counting(where: str, args: tuple[Any, ...], with_spec: bool = True) -> Any:
        loads.append(where)
        return original(where, args, with_spec)

    store._select = counting  # type: ignore[method-assign]
    try:
        began = time.monotonic()
        [refused] = as_user(12345, daemon.socket, {"op": "suspend", "job_ids": [theirs] * 10_000})
        assert refused["error"]["code"] == "permission_denied", refused
        assert loads == [], "a job was loaded to refuse a request"
        assert time.monotonic() - began < 15
        with daemon.client() as c:
            mine = c.raw_call({"op": "hold", "job_ids": [theirs] * 10_000})
        assert mine["ok"] and mine["result"]["unchanged"] == {str(theirs): "job is CANCELLED, it has ended"}
        assert loads == []
    finally:
        del store._select


def test_stats_and_queue_all_read_on_a_worker_thread(daemon: DaemonHandle) -> None:
    """While a big read runs, the loop answers others: the reads run on a connection of their own."""
    assert daemon.daemon is not None and daemon.loop is not None
    with daemon.client() as c:
        ids = [_submit(c, _spec("true")) for _ in range(3)]
        c.call(CancelRequest(job_ids=ids), CancelResult)
        threads: list[str] = []
        original = StoreReader.summaries

        def spy(self: Any, **kw: Any) -> Any:
            import threading
            threads.append(threading.current_thread().name)
            return original(self, **kw)

        StoreReader.summaries = spy  # type: ignore[method-assign]
        try:
            listed = c.call(QueueRequest(all=True), QueueResult)
        finally:
            StoreReader.summaries = original  # type: ignore[method-assign]
        assert [j.id for j in listed.jobs] == ids
        assert threads and all(name != "gpuschedd" for name in threads), threads
        assert daemon.thread is not None and daemon.thread.name == "gpuschedd"


# ---- items 5 and 11: bounded, escaped listings -----------------------------------------------------


ESCAPES = "\x1b[2J\x1b]52;c;ZXZpbA==\x07\x9b31m\u202eevil"


def test_huge_program_names_and_terminal_escapes_do_not_break_queue_or_top(daemon: DaemonHandle) -> None:
    """Five held jobs with a 250 KB argv[0] made every `queue` and `top` reply exceed 1 MiB; names with
    escapes cleared other users' screens and wrote their clipboards. (argv[0] is now at most what
    execve takes, 128 KiB: nine of those are over 1 MiB too.)"""
    long_program = "/" + "p" * (MAX_ARG_STRLEN - 10)
    with daemon.client() as c:
        for _ in range(9):
            _submit(c, _spec(long_program))
        named = _submit(c, _spec("true", name=ESCAPES))
        listed = c.call(QueueRequest(), QueueResult)
    assert len(listed.jobs) == 10 and all(len(j.name) <= MAX_DISPLAY_NAME for j in listed.jobs)
    runner = CliRunner()
    for args in (["queue"], ["top", "--once"], ["show", str(named)], ["queue", "--all"]):
        result = runner.invoke(cli, ["--socket", daemon.socket, *args], catch_exceptions=False)
        assert result.exit_code == 0, (args, result.output[-2000:])
        assert len(result.output) < 64 * 1024, args
        for raw in ("\x1b", "\x07", "\x9b", "\u202e"):
            assert raw not in result.output, (args, raw)
        if args[0] != "top":  # top lists pending jobs, not held ones
            assert "\\x1b[2J" in result.output, args


def test_a_listing_stops_before_its_reply_would_exceed_a_frame(daemon: DaemonHandle) -> None:
    """3,000 rows of 64 four-byte characters each are 1.5 MB: the reply stops short and says so."""
    name = "\U0001F600" * MAX_DISPLAY_NAME
    with daemon.client() as c:
        for _ in range(2600):
            c.call(SubmitRequest(spec=_spec("true", name=name), hold=True), SubmitResult)
        raw = c.raw_call(QueueRequest(limit=3000).model_dump(mode="json"))
    assert raw["ok"] is True, raw
    result = QueueResult.model_validate(raw["result"])
    assert result.total == 2600 and 0 < len(result.jobs) < 2600
    assert len(encode_frame(raw)) <= MAX_FRAME


# ---- item 12: a deadline on every read ----------------------------------------------------------


def _hello(s: socket.socket) -> None:
    s.sendall(encode_frame({"op": "hello", "version": PROTOCOL_VERSION}))
    assert _read(s)["ok"] is True


def _read(s: socket.socket) -> dict[str, Any]:
    header = s.recv(4, socket.MSG_WAITALL)
    assert len(header) == 4, "connection closed"
    return decode_body(s.recv(struct.unpack(">I", header)[0], socket.MSG_WAITALL))


def _closed(s: socket.socket) -> bool:
    return s.recv(1) == b""


@pytest.mark.parametrize("stall", ["mid-body", "mid-header"])
def test_a_connection_that_stalls_mid_frame_is_closed(daemon_factory: Callable[..., DaemonHandle],
                                                      stall: str) -> None:
    handle = daemon_factory(client_read_timeout_s=0.5)
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(handle.socket)
        _hello(s)
        s.sendall(struct.pack(">I", 100) + b"{" if stall == "mid-body" else b"\x00\x00")
        began = time.monotonic()
        reply = _read(s)
        assert reply["error"]["code"] == "bad_frame" and "not completed within 0.5 s" in reply["error"]["message"]
        assert _closed(s) and time.monotonic() - began < 5


def test_an_idle_connection_is_closed_after_the_idle_timeout(daemon_factory: Callable[..., DaemonHandle]) -> None:
    handle = daemon_factory(client_idle_timeout_s=0.5)
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(handle.socket)
        _hello(s)
        began = time.monotonic()
        assert _closed(s) and 0.4 < time.monotonic() - began < 5
    with handle.client() as c:  # a client busy with requests is not idle
        for _ in range(3):
            c.call(QueueRequest(), QueueResult)
            time.sleep(0.2)


def test_queue_json_shape_is_unchanged_for_finished_jobs(daemon: DaemonHandle) -> None:
    """Finished rows now come from the listing columns, not the spec: same fields, same values."""
    with daemon.client() as c:
        job_id = _submit(c, _spec("/usr/bin/true", name=None), hold=True)
        before = c.call(QueueRequest(), QueueResult).jobs[0]
        c.call(CancelRequest(job_ids=[job_id]), CancelResult)
        after = c.call(QueueRequest(all=True), QueueResult).jobs[0]
    assert (after.name, after.request, after.user, after.uid) == (before.name, before.request, before.user,
                                                                  before.uid) == ("true", "gpus=1", before.user,
                                                                                  before.uid)
    assert after.state is JobState.CANCELLED and json.loads(after.model_dump_json())["ended_at"] is not None
