"""bench/bare_server.py, bench_api's ceiling, keeps the promise that makes it a fair ceiling: a submit
is answered only once its row is committed. A ceiling that answered before its COMMIT would make
gpuschedd look slower than a durable server can be."""

from __future__ import annotations

import socket
import sqlite3
import tempfile
from collections.abc import Callable
from types import ModuleType

import pytest

from gpusched.protocol import SubmitRequest
from gpusched.wire import decode_body, encode_frame, frame_length


def _submit(i: int) -> bytes:
    """A submit as `gpusched submit` sends it (valid for gpusched's own models: --checked validates it)."""
    spec = {"argv": ["true"], "cwd": "/tmp", "env": {"A": "1"}, "request": {"kind": "whole", "gpus": 1}}
    return encode_frame(SubmitRequest.model_validate({"spec": spec, "request_id": f"{i:032x}"}).model_dump(mode="json"))


def _answer(sock: socket.socket) -> dict[str, object]:
    header = sock.recv(4, socket.MSG_WAITALL)
    return decode_body(sock.recv(frame_length(header), socket.MSG_WAITALL))


def _connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(path)
    sock.sendall(encode_frame({"op": "hello", "version": "1.1", "client": "test"}))
    assert _answer(sock)["ok"] is True
    return sock


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checked", [False, True])
def test_answers_only_committed_submits(checked: bool, bench_module: Callable[[str], ModuleType]) -> None:
    harness = bench_module("harness")
    with tempfile.TemporaryDirectory(prefix="gbt-", dir="/tmp") as folder, \
            harness.BareServer(folder, checked=checked) as server:
        socks = [_connect(server.socket) for _ in range(4)]
        reader = sqlite3.connect(f"file:{server.database}?mode=ro", uri=True)
        seen: list[int] = []
        try:
            for _ in range(5):
                for sock in socks:  # all four in flight at once: one turn of its loop, one COMMIT
                    sock.sendall(_submit(len(seen) + socks.index(sock)))
                for sock in socks:
                    reply = _answer(sock)
                    assert reply["ok"] is True
                    result = reply["result"]
                    assert isinstance(result, dict) and result["state"] == "PENDING"
                    job_id = result["job_id"]
                    # Committed before it was answered: another connection already reads the row.
                    row = reader.execute("SELECT spec FROM jobs WHERE id = ?", (job_id,)).fetchone()
                    assert row is not None and '"argv":["true"]' in row[0]
                    keys = reader.execute("SELECT count(*) FROM submit_keys WHERE job_id = ?", (job_id,)).fetchone()
                    assert keys == (1 if checked else 0,)  # the request_id, with --checked
                    seen.append(job_id)
        finally:
            reader.close()
            for sock in socks:
                sock.close()
        assert sorted(seen) == list(range(1, 21))
        pid = server.pid
    assert server.proc is not None and server.proc.poll() is not None, f"bare server {pid} still running"
