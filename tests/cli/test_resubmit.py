"""`gpusched submit` sends its request again (same request_id) when the daemon goes away before
answering, and the daemon answers with the job the first attempt created: never two jobs."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from gpusched.model import JobSpec, JobState, WholeRequest
from gpusched.protocol import QueueRequest, QueueResult, SubmitRequest, SubmitResult
from gpusched_cli import resubmit
from gpusched_cli.client import DaemonUnavailable
from tests.conftest import DaemonHandle

SPEC = JobSpec(argv=["true"], cwd="/tmp", request=WholeRequest(gpus=1), name="once")


def test_a_submit_is_sent_again_across_a_restart_and_queued_once(daemon_factory: Callable[..., DaemonHandle]) -> None:
    d = daemon_factory()
    request = SubmitRequest(spec=SPEC, hold=True, request_id=resubmit.new_request_id())
    answers: list[SubmitResult] = []
    with d.client() as c:
        first = c.call(request, SubmitResult)  # committed; as if its answer had been lost in the crash below
        d.stop()
        sender = threading.Thread(target=lambda: answers.append(resubmit.submit(c, request, retry_for_s=30)))
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
            resubmit.submit(c, request, retry_for_s=0.5)
