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

The benchmarks start it through `harness.BareServer`. This script imports nothing of gpusched
but its framing (`gpusched.wire`, standard library only) unless --checked: the bare server's heap
stays the size of a bare server's.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
import sys
import time
from typing import cast

from gpusched.wire import HEADER, encode_frame, frame_length


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
                transport.write(encode_frame({"ok": True, "result": {"job_id": job_id, "state": "PENDING"}}))


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
        while len(self.buffer) >= HEADER.size:
            end = HEADER.size + frame_length(bytes(self.buffer[: HEADER.size]))  # (gpuschedd's own limits)
            if len(self.buffer) < end:
                return
            body = bytes(self.buffer[HEADER.size : end])
            del self.buffer[:end]
            if self.checks is not None:
                self._checked(self.checks, body)
                continue
            message = json.loads(body)
            if message.get("op") == "submit":
                self.submits.add(self.transport, json.dumps(message["spec"], separators=(",", ":")))
            else:  # hello (the only other request bench_api's clients send)
                self.transport.write(encode_frame({"ok": True, "result": {"version": message.get("version")}}))

    def _checked(self, checks: _Checks, body: bytes) -> None:
        assert self.transport is not None
        request = checks.parse_frame(body)  # raises on a frame gpuschedd would refuse: a benchmark's bug
        if isinstance(request, checks.submit_request):
            self.submits.add(self.transport, checks.spec_json(request.spec).decode(), request.request_id)
        else:
            self.transport.write(encode_frame({"ok": True, "result": {"version": getattr(request, "version", None)}}))


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
