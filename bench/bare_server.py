"""The least a durable submit server written in Python can do: bench_api's ceiling for gpuschedd.

It speaks gpusched's framing on a Unix socket and answers `hello` and `submit` as gpuschedd does,
and does nothing else a real daemon must: no validation of the request, no peer credentials, no
limits, no request_id, no scheduler, no in-memory mirror of the queue. A submit's spec is stored
as JSON in one row of one table (WAL, synchronous=FULL, as gpuschedd's store), the submits that
arrived in one turn of the event loop share one COMMIT (group commit at its simplest: one turn,
where gpuschedd waits up to eight), and each is answered only after that COMMIT returned. The
loop is uvloop's, as gpuschedd's.

`--checked` adds the two things of a submit's path that come from the protocol rather than from
the daemon's design: each frame is validated by gpusched's own request models
(`gpusched.protocol.parse_frame`, every check the daemon makes of a submit's fields), the spec is
stored as the daemon stores it (its pydantic serializer), and the request_id goes into a
`submit_keys` table with the daemon's primary key, in the same transaction.

So its submits per second, measured with the same clients on the same disk in the same run, are
what the machine allows a Python server with gpuschedd's durability: bench_api prints gpuschedd's
rate as a fraction of it, a figure that moves far less with the machine's speed than the ratio
to the single-commit floor (a CPU-bound daemon against an fsync-bound floor).

    python bench/bare_server.py SOCKET DATABASE [--checked]   # prints "ready" once it listens; SIGTERM stops it
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from types import TracebackType
from typing import Any, cast

_HEADER_BYTES = 4


def _frame(message: dict[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    return len(body).to_bytes(_HEADER_BYTES, "big") + body


class _Submits:
    """Submits waiting for the next COMMIT, and the database they go to."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db
        self.waiting: list[tuple[asyncio.Transport, str, str | None]] = []

    def add(self, transport: asyncio.Transport, spec: str, request_id: str | None = None) -> None:
        if not self.waiting:  # the first of a batch: commit once this turn of the loop is over
            asyncio.get_running_loop().call_soon(self.commit)
        self.waiting.append((transport, spec, request_id))

    def commit(self) -> None:
        batch, self.waiting = self.waiting, []
        now = time.time()
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        ids = []
        for _, spec, request_id in batch:
            job_id = db.execute("INSERT INTO jobs (spec, submitted_at) VALUES (?, ?)", (spec, now)).lastrowid
            if request_id is not None:
                db.execute("INSERT INTO submit_keys (uid, key, job_id) VALUES (?, ?, ?)", (0, request_id, job_id))
            ids.append(job_id)
        db.execute("COMMIT")
        for (transport, _, _), job_id in zip(batch, ids, strict=True):
            if not transport.is_closing():
                transport.write(_frame({"ok": True, "result": {"job_id": job_id, "state": "PENDING"}}))


class _Checks:
    """--checked: gpusched's own request models and its store's spec serializer, imported once,
    before the server says it is ready (so no submit pays for the import)."""

    def __init__(self) -> None:
        from gpusched.model import JobSpec
        from gpusched.protocol import SubmitRequest, parse_frame

        self.parse_frame = parse_frame
        self.submit_request = SubmitRequest
        self.spec_json = JobSpec.__pydantic_serializer__.to_json  # what gpuschedd's store writes


class _Connection(asyncio.Protocol):
    def __init__(self, submits: _Submits, checks: _Checks | None) -> None:
        self.submits = submits
        self.checks = checks
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's transports are not asyncio's classes)

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        self.buffer += data
        while len(self.buffer) >= _HEADER_BYTES:
            size = int.from_bytes(self.buffer[:_HEADER_BYTES], "big")
            if len(self.buffer) < _HEADER_BYTES + size:
                return
            body = bytes(self.buffer[_HEADER_BYTES : _HEADER_BYTES + size])
            del self.buffer[: _HEADER_BYTES + size]
            if self.checks is not None:
                self._checked(self.checks, body)
                continue
            message = json.loads(body)
            if message.get("op") == "submit":
                self.submits.add(self.transport, json.dumps(message["spec"], separators=(",", ":")))
            else:  # hello (the only other request bench_api's clients send)
                self.transport.write(_frame({"ok": True, "result": {"version": message.get("version")}}))

    def _checked(self, checks: _Checks, body: bytes) -> None:
        assert self.transport is not None
        request = checks.parse_frame(body)  # raises on a frame gpuschedd would refuse: a benchmark's bug
        if isinstance(request, checks.submit_request):
            self.submits.add(self.transport, checks.spec_json(request.spec).decode(), request.request_id)
        else:
            self.transport.write(_frame({"ok": True, "result": {"version": getattr(request, "version", None)}}))


def open_database(path: str) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute("CREATE TABLE IF NOT EXISTS jobs (id INTEGER PRIMARY KEY AUTOINCREMENT, spec TEXT NOT NULL,"
               " submitted_at REAL NOT NULL)")
    db.execute("CREATE TABLE IF NOT EXISTS submit_keys (uid INTEGER NOT NULL, key TEXT NOT NULL,"
               " job_id INTEGER NOT NULL, PRIMARY KEY (uid, key))")  # (gpuschedd's schema.py)
    return db


async def serve(socket_path: str, db: sqlite3.Connection, checked: bool) -> None:
    loop = asyncio.get_running_loop()
    stop = loop.create_future()
    loop.add_signal_handler(signal.SIGTERM, stop.set_result, None)
    submits = _Submits(db)
    checks = _Checks() if checked else None
    server = await loop.create_unix_server(lambda: _Connection(submits, checks), socket_path)
    print("ready", flush=True)
    await stop
    server.close()


class BareServer:
    """This script as a child process, for bench_api: `with BareServer(folder) as bare: bare.socket`;
    `checked`: with --checked; `wrapper`: what runs it (valgrind, for instructions_daemon.py)."""

    def __init__(self, folder: str, checked: bool = False, wrapper: tuple[str, ...] = ()) -> None:
        name = "checked" if checked else "bare"
        self.socket = os.path.join(folder, f"{name}.sock")
        self.database = os.path.join(folder, f"{name}.db")
        self.checked = checked
        self.wrapper = wrapper
        self.proc: subprocess.Popen[str] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def __enter__(self) -> BareServer:
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # (--checked imports gpusched)
        path = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen([*self.wrapper, sys.executable, os.path.abspath(__file__), self.socket,
                                      self.database, *(["--checked"] if self.checked else [])],
                                     stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": path},
                                     stderr=subprocess.DEVNULL if self.wrapper else None)  # (valgrind's report)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # (an exit closes the pipe: no wait for ever)
        if line.strip() != "ready":
            self.__exit__(None, None, None)
            raise RuntimeError(f"bench/bare_server.py did not start (exit status {self.proc.wait(10)})")
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(self.database + suffix):
                os.remove(self.database + suffix)


def main() -> int:
    args = sys.argv[1:]
    checked = "--checked" in args
    if checked:
        args.remove("--checked")
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    socket_path, database = args
    db = open_database(database)
    try:
        import uvloop
    except ImportError:  # (a dependency of gpusched; asyncio's own loop if it is missing)
        asyncio.run(serve(socket_path, db, checked))
    else:
        uvloop.run(serve(socket_path, db, checked))
    db.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
