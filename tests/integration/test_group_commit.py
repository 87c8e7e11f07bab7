"""Group commit through the real daemon: submits share COMMITs, an answer means the job is stored,
and a submit sent again with its request_id (after a crash ate the answer) is never queued twice.

The storm below is the issue's proof: 16 clients submit to the real `gpuschedd` program while it
is `kill -9`ed; every acknowledged job is in the database after the restart, and a client that
lost its answer sends the same request again and gets the job its first attempt created (if it
was committed) instead of a second one.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable

import pytest

from gpusched.daemon.store import StoreReader
from gpusched.model import JobSpec, JobState, WholeRequest
from gpusched.protocol import (
    PROTOCOL_VERSION,
    ErrorCode,
    ProtocolError,
    SubmitRequest,
    SubmitResult,
    encode_frame,
)
from gpusched_cli.client import Client, DaemonUnavailable
from tests.conftest import DaemonHandle, DaemonProcess

CLIENTS = 16


def spec(name: str) -> JobSpec:
    return JobSpec(argv=["true"], cwd="/tmp", env={"PATH": "/usr/bin:/bin"}, request=WholeRequest(gpus=1), name=name)


def stored_names(state_dir: str) -> dict[str, list[int]]:
    reader = StoreReader.open(os.path.join(state_dir, "gpusched.db"))
    try:
        rows = reader.summaries(limit=10**6, after_id=0)
    finally:
        reader.close()
    out: dict[str, list[int]] = {}
    for row in rows:
        out.setdefault(row.display, []).append(row.id)
    return out


def test_concurrent_submits_share_one_commit(daemon: DaemonHandle) -> None:
    assert daemon.daemon is not None and daemon.loop is not None
    engine = daemon.daemon.engine

    async def sixteen() -> list[SubmitResult]:
        before = engine.commits.commits
        results = await asyncio.gather(*(engine.submit(uid=0, gid=0, user="root", spec=spec(f"g{i}"), hold=True)
                                         for i in range(CLIENTS)))
        assert engine.commits.commits == before + 1  # sixteen submits, one COMMIT
        return results

    results = asyncio.run_coroutine_threadsafe(sixteen(), daemon.loop).result(30)
    assert len({r.job_id for r in results}) == CLIENTS
    assert sorted(stored_names(daemon.state_dir)) == sorted(f"g{i}" for i in range(CLIENTS))


def test_a_submit_sent_again_with_its_request_id_is_not_queued_twice(daemon: DaemonHandle) -> None:
    request = SubmitRequest(spec=spec("once"), hold=True, request_id=uuid.uuid4().hex)
    # The first attempt: sent, and the connection dropped before the answer was read (as a crash would).
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(daemon.socket)
    raw.sendall(encode_frame({"op": "hello", "version": PROTOCOL_VERSION, "client": "test"}))
    raw.sendall(encode_frame(request.model_dump(mode="json")))
    raw.shutdown(socket.SHUT_WR)
    raw.recv(65536)  # at least the hello's answer; the submit's may or may not come
    raw.close()
    with daemon.client() as c:
        again = c.call(request, SubmitResult)
        assert again.duplicate and again.state is JobState.HELD
        assert c.call(request, SubmitResult).job_id == again.job_id
        other = c.call(request.model_copy(update={"request_id": uuid.uuid4().hex}), SubmitResult)
        assert not other.duplicate and other.job_id != again.job_id
    assert stored_names(daemon.state_dir)["once"] == sorted([again.job_id, other.job_id])


def test_the_same_request_id_in_flight_twice_makes_one_job(daemon: DaemonHandle) -> None:
    assert daemon.daemon is not None and daemon.loop is not None
    engine = daemon.daemon.engine
    key = uuid.uuid4().hex

    async def twice() -> list[SubmitResult]:
        return await asyncio.gather(*(engine.submit(uid=0, gid=0, user="root", spec=spec("twin"), hold=True,
                                                    request_id=key) for _ in range(2)))

    first, second = asyncio.run_coroutine_threadsafe(twice(), daemon.loop).result(30)
    assert first.job_id == second.job_id and [first.duplicate, second.duplicate] == [False, True]
    assert len(stored_names(daemon.state_dir)["twin"]) == 1


def test_a_retry_committed_with_new_submits_is_answered_alone(daemon: DaemonHandle) -> None:
    """A submit's key is checked by the table's primary key as it is written, not looked up first:
    a retry that lands in a batch with new submits fails alone (the batch is written again write by
    write), is answered with the job its first attempt made, and the new ones are queued once each."""
    assert daemon.daemon is not None and daemon.loop is not None
    engine = daemon.daemon.engine
    key = uuid.uuid4().hex

    async def retry_among_new() -> tuple[SubmitResult, list[SubmitResult]]:
        first = await engine.submit(uid=0, gid=0, user="root", spec=spec("retried"), hold=True, request_id=key)
        batch = await asyncio.gather(
            engine.submit(uid=0, gid=0, user="root", spec=spec("retried"), hold=True, request_id=key),
            *(engine.submit(uid=0, gid=0, user="root", spec=spec("new"), hold=True, request_id=uuid.uuid4().hex)
              for _ in range(3)))
        return first, batch

    before = engine.commits.commits
    first, (again, *new) = asyncio.run_coroutine_threadsafe(retry_among_new(), daemon.loop).result(30)
    assert engine.commits.commits == before + 2  # the retry was in the second COMMIT, with the new ones
    assert again.model_dump() == {**first.model_dump(), "duplicate": True}
    assert not any(r.duplicate for r in new) and len({r.job_id for r in new}) == 3
    assert stored_names(daemon.state_dir) == {"retried": [first.job_id], "new": sorted(r.job_id for r in new)}


def test_a_retry_is_answered_with_its_job_even_at_the_users_limit(daemon_factory: Callable[..., DaemonHandle],
                                                                 ) -> None:
    """The first attempt filled the user's last pending place: the retry is not refused for the
    limit its own job now fills, but answered with that job."""
    daemon = daemon_factory(max_pending_per_user=1)
    assert daemon.daemon is not None and daemon.loop is not None
    engine = daemon.daemon.engine
    key = uuid.uuid4().hex

    def submit(request_id: str) -> SubmitResult:
        return asyncio.run_coroutine_threadsafe(
            engine.submit(uid=4321, gid=4321, user="bob", spec=spec("limited"), hold=True, request_id=request_id),
            daemon.loop).result(30)

    first = submit(key)
    assert submit(key).model_dump() == {**first.model_dump(), "duplicate": True}
    with pytest.raises(ProtocolError) as refused:
        submit(uuid.uuid4().hex)  # a new request is refused: the limit stands
    assert refused.value.code is ErrorCode.LIMIT_EXCEEDED


def test_request_ids_are_per_user_and_survive_a_restart(daemon: DaemonHandle) -> None:
    request = SubmitRequest(spec=spec("kept"), hold=True, request_id="same-key")
    with daemon.client() as c:
        first = c.call(request, SubmitResult)
    daemon.restart()
    with daemon.client() as c:
        assert c.call(request, SubmitResult).model_dump() == {**first.model_dump(), "duplicate": True}
        array = c.call(request.model_copy(update={"array": "1-3", "request_id": "array-key"}), SubmitResult)
        assert c.call(request.model_copy(update={"array": "1-3", "request_id": "array-key"}),
                      SubmitResult).model_dump() == {**array.model_dump(), "duplicate": True}


def test_kill_9_while_16_clients_submit_loses_and_duplicates_nothing(
    daemon_process: Callable[..., DaemonProcess],
) -> None:
    proc = daemon_process()
    proc.extra_config = "max_pending_per_user = 1000000\nsubmit_rate_per_user = 1000000.0\n"
    proc.start()
    acked: dict[str, int] = {}  # name -> job id from the answer
    retried: dict[str, int] = {}  # name -> job id from the answer to the same request sent again
    duplicates: list[str] = []  # answers that said "this request_id was already committed"
    lock = threading.Lock()
    errors: list[BaseException] = []
    stop = threading.Event()
    rounds = 3

    def client(t: int) -> None:
        rng = random.Random(t)
        c = Client(proc.socket, timeout=30)
        try:
            i = 0
            while not stop.is_set():
                name = f"c{t}-{i}"
                request = SubmitRequest(spec=spec(name), hold=True, request_id=f"{t}-{i}-{uuid.uuid4().hex}")
                first_try = True
                while True:  # what `gpusched submit` does (cli/gpusched_cli/resubmit.py), counted
                    try:
                        if c._sock is None:
                            c.connect()
                        reply = c.call(request, SubmitResult)
                        break
                    except (DaemonUnavailable, ConnectionError, TimeoutError, ProtocolError):
                        first_try = False
                        c.close()
                        time.sleep(0.05)
                with lock:
                    (acked if first_try else retried)[name] = reply.job_id
                    if reply.duplicate:
                        duplicates.append(name)
                i += 1
                if rng.random() < 0.01:
                    time.sleep(0.01)
        except BaseException as exc:
            errors.append(exc)
        finally:
            c.close()

    threads = [threading.Thread(target=client, args=(t,)) for t in range(CLIENTS)]
    for t in threads:
        t.start()
    try:
        for _ in range(rounds):
            goal = len(acked) + len(retried) + 300
            deadline = time.monotonic() + 60
            while len(acked) + len(retried) < goal and time.monotonic() < deadline:
                time.sleep(0.01)
            proc.kill9()
            proc.start()
        goal = len(acked) + len(retried) + 100  # served again after the last restart
        deadline = time.monotonic() + 60
        while len(acked) + len(retried) < goal and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not errors, errors[0]
    assert len(acked) + len(retried) >= rounds * 300
    proc.terminate()

    stored = stored_names(proc.state_dir)
    answered = {**acked, **retried}
    # Every request a client sent was answered in the end (it sends again until answered), so the
    # store must hold exactly the answered jobs, each once, under the id its answer gave.
    problems = [f"{name}: answered job {job_id}, stored as {stored.get(name)}"
                for name, job_id in answered.items() if stored.get(name) != [job_id]]
    problems += [f"{name}: stored as {stored[name]} but never answered" for name in stored.keys() - answered.keys()]
    assert not problems, "\n".join(problems[:20])
    print(f"\ngroup commit storm: {rounds} kill -9, {len(acked)} answered at once, {len(retried)} answered after "
          f"sending again ({len(duplicates)} of those had been committed before the crash), "
          f"{sum(map(len, stored.values()))} stored")
