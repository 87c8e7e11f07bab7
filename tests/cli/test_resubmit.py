"""`gpusched submit` sends its request again (same request_id) when the daemon goes away before
answering, and the daemon answers with the job the first attempt created: never two jobs."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from click.testing import CliRunner

from gpusched.model import JobSpec, JobState, WholeRequest
from gpusched.protocol import QueueRequest, QueueResult, SubmitRequest, SubmitResult
from gpusched_cli import resubmit
from gpusched_cli.client import Client, DaemonUnavailable
from gpusched_cli.main import cli
from tests.conftest import DaemonHandle

SPEC = JobSpec(argv=["true"], cwd="/tmp", request=WholeRequest(gpus=1), name="once")


def test_request_ids_are_unique_and_in_the_order_they_were_made() -> None:
    """The daemon's index of request_ids takes keys made in order at its end (resubmit.new_request_id)."""
    began = time.time_ns()
    ids = [resubmit.new_request_id() for _ in range(2000)]
    ended = time.time_ns()
    assert all(re.fullmatch(r"[0-9a-f]{32}", key) for key in ids)
    assert len(set(ids)) == len(ids)
    made = [int(key[:16], 16) for key in ids]
    assert made == sorted(made) and began <= made[0] and made[-1] <= ended
    SubmitRequest(spec=SPEC, request_id=ids[0])  # what the protocol accepts


def test_a_submit_is_sent_again_across_a_restart_and_queued_once(daemon_factory: Callable[..., DaemonHandle]) -> None:
    d = daemon_factory()
    request = SubmitRequest(spec=SPEC, hold=True, request_id=resubmit.new_request_id())
    answers: list[SubmitResult] = []
    with d.client() as c:
        first = c.call(request, SubmitResult)  # committed; as if its answer had been lost in the crash below
        d.stop()

        def send_again() -> None:  # the CLI's plain JSON path, read back through the model
            answers.append(SubmitResult.model_validate(resubmit.submit(c, request.model_dump(mode="json"),
                                                                       retry_for_s=30)))

        sender = threading.Thread(target=send_again)
        sender.start()  # finds the connection dead, then the socket gone, and keeps trying
        d.start()
        sender.join(40)
    assert answers and answers[0].job_id == first.job_id and answers[0].duplicate
    assert answers[0].state is JobState.HELD
    with d.client() as c:
        assert [j.id for j in c.call(QueueRequest(), QueueResult).jobs] == [first.job_id]


def test_it_gives_up_when_the_daemon_stays_away(daemon_factory: Callable[..., DaemonHandle]) -> None:
    d = daemon_factory()
    request = SubmitRequest(spec=SPEC, request_id=resubmit.new_request_id())
    with d.client() as c:
        d.stop()
        with pytest.raises((DaemonUnavailable, ConnectionError)):
            resubmit.submit(c, request.model_dump(mode="json"), retry_for_s=0.5)


def test_a_1_0_daemon_gets_the_submit_once_and_without_request_id(
    daemon_factory: Callable[..., DaemonHandle], monkeypatch: pytest.MonkeyPatch
) -> None:
    """request_id came with protocol 1.1: a 1.0 daemon's models would refuse the member, and it could
    not recognise a resend, so the submit goes out once without it."""
    from gpusched.daemon import handlers

    d = daemon_factory()
    monkeypatch.setattr(handlers, "PROTOCOL_VERSION", "1.0")  # the daemon says hello as 1.0 would
    sent: list[dict[str, Any]] = []
    with d.client() as c:
        assert c.hello is not None and c.hello["version"] == "1.0"
        raw_call = c.raw_call

        def recording(message: dict[str, Any]) -> dict[str, Any]:
            sent.append(message)
            return raw_call(message)

        monkeypatch.setattr(c, "raw_call", recording)
        request = SubmitRequest(spec=SPEC, hold=True, request_id=resubmit.new_request_id())
        answer = SubmitResult.model_validate(resubmit.submit(c, request.model_dump(mode="json")))
    assert [m["op"] for m in sent] == ["submit"] and "request_id" not in sent[0]
    assert answer.state is JobState.HELD and not answer.duplicate


def test_gpusched_submit_sends_a_fresh_request_id_each_time(
    daemon_factory: Callable[..., DaemonHandle], monkeypatch: pytest.MonkeyPatch
) -> None:
    d = daemon_factory()
    sent: list[dict[str, Any]] = []
    raw_call = Client.raw_call

    def recording(self: Client, message: dict[str, Any]) -> dict[str, Any]:
        sent.append(message)
        return raw_call(self, message)

    monkeypatch.setattr(Client, "raw_call", recording)
    for _ in range(2):
        result = CliRunner().invoke(cli, ["--socket", d.socket, "submit", "--hold", "--gpus", "1", "--", "true"])
        assert result.exit_code == 0, result.output
    ids = [m["request_id"] for m in sent if m["op"] == "submit"]
    assert len(ids) == 2 and ids[0] != ids[1] and all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
