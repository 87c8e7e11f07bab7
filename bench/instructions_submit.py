"""The daemon's instructions per submit under many concurrent clients, counted by callgrind.

Wall-clock rates are noise on a small, shared machine; instruction counts are not. The daemon is
booted in-process (as tests/conftest.py boots it) with every GPU drained, so nothing starts and
no process is forked. `--clients` connections are served by the real `Server._session` (framing,
parsing, handler, engine, group commit, scheduling pass, the answer), each the daemon's own
`Connection` fed its submit frames as the CLI encodes them, over a transport that only checks
each answer says ok; one submit in flight per connection, as a blocking client has it, so group
commit batches up to `--clients` of them. Only the measured submits are counted (they run inside
`sys.call_tracing`, callgrind's --toggle-collect point): start-up and `--warmup` submits are not.

    python bench/instructions_submit.py                    # 2000 submits, 16 clients: prints instr/submit
    python bench/instructions_submit.py --submits 500 --clients 12
    python bench/instructions_submit.py --inner            # the driver alone, without valgrind
    python bench/instructions_submit.py --quick            # its smoke run (tests/bench/test_smoke.py)

Runs under valgrind (`apt-get install valgrind`) with PYTHONHASHSEED=0; compare two trees with the
same arguments and the same GPUSCHED_PURE_PYTHON. Figures are of the tree the script lies in.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from typing import cast

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import harness as h

from gpusched.config import DaemonConfig
from gpusched.daemon import main as daemon_main
from gpusched.daemon.connection import Connection
from gpusched.daemon.handlers import Peer
from gpusched.daemon.server import Server
from gpusched.protocol import PROTOCOL_VERSION, HelloRequest, SubmitRequest, encode_frame
from gpusched.wire import HEADER
from gpusched_cli.resubmit import new_request_id

SIM = "H100-80GB:8"
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/home/alice", "LANG": "C.UTF-8"}
PEER = Peer(pid=4242, uid=4242, gid=4242)  # an ordinary user: the per-user limits are checked too
_OK = b'{"ok":true'


class _Transport:
    """The connection's transport: counts answers, and those that are not ok; the kernel takes every write."""

    def __init__(self, done: asyncio.Event, target: list[int]) -> None:
        self.answers = 0
        self.refused = 0
        self._done, self._target = done, target

    def write(self, data: bytes) -> None:
        if not data.startswith(_OK, HEADER.size):
            self.refused += 1
        self.answers += 1
        if self.answers == self._target[0]:
            self._done.set()

    def get_write_buffer_size(self) -> int:
        return 0  # the kernel took it all: no drain

    def get_extra_info(self, name: str) -> None:
        return None

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Client:
    """One connection: its session, the frames fed to it, and what it was answered."""

    def __init__(self, server: Server) -> None:
        self.done = asyncio.Event()
        self.target = [0]
        self.transport = _Transport(self.done, self.target)
        self.conn = Connection(lambda conn: server._session(conn, PEER))  # (no socket: the peer is given)
        self.conn.connection_made(cast(asyncio.Transport, self.transport))
        assert self.conn.task is not None
        self.session = self.conn.task

    async def send(self, frames: list[bytes]) -> None:
        """Feed `frames` and wait for their answers (the session reads the next after answering one)."""
        self.done.clear()
        self.target[0] = self.transport.answers + len(frames)
        self.conn.data_received(b"".join(frames))
        await self.done.wait()


def _submit_frame(i: int, request_ids: str) -> bytes:
    """The i-th submit; with a request_id as `gpusched submit` makes them (`cli`), 128 random bits
    (`random`, as the CLI made them before round 18), or none."""
    spec = {"argv": ["python", "train.py", f"--seed={i}"], "cwd": "/home/alice/sweep", "env": ENV,
            "request": {"kind": "whole", "gpus": 1}}
    request_id = {"cli": new_request_id, "random": h.random_request_id, "none": lambda: None}[request_ids]()
    return encode_frame(SubmitRequest.model_validate({"spec": spec, "request_id": request_id}).model_dump(mode="json"))


async def _connect(server: Server, clients: int) -> list[_Client]:
    """The connections, made in the loop as the server's own are."""
    return [_Client(server) for _ in range(clients)]


async def _round(clients: list[_Client], frames: list[bytes]) -> None:
    """Each client sends its share of `frames` (one at a time, as a blocking client does)."""
    shares = [frames[i :: len(clients)] for i in range(len(clients))]
    await asyncio.gather(*(c.send(share) for c, share in zip(clients, shares, strict=True) if share))


def inner(submits: int, warmup: int, clients: int, request_ids: str = "cli") -> int:
    base = tempfile.mkdtemp(prefix="gsi", dir="/tmp")
    config = DaemonConfig(socket=os.path.join(base, "g.sock"), state_dir=os.path.join(base, "state"), sim=SIM,
                          allow_root_jobs=True, cgroup_root="off", max_pending_per_user=10**7,
                          submit_rate_per_user=1e9)
    frames = [_submit_frame(i, request_ids) for i in range(warmup + submits)]
    hello = encode_frame(HelloRequest(version=PROTOCOL_VERSION, client="bench").model_dump(mode="json"))
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    daemon = loop.run_until_complete(daemon_main.start(config))
    try:
        for gpu in range(8):  # nothing starts: the queue only grows, as behind a long job
            daemon.engine.drain(str(gpu), "bench")
        conns = loop.run_until_complete(_connect(daemon.server, clients))
        loop.run_until_complete(_round(conns, [hello] * clients))
        loop.run_until_complete(_round(conns, frames[:warmup]))
        commits, writes = daemon.engine.commits.commits, daemon.engine.commits.writes
        # Counted by callgrind (--toggle-collect=sys_call_tracing): the measured submits only.
        sys.call_tracing(loop.run_until_complete, (_round(conns, frames[warmup:]),))
        batches = daemon.engine.commits.commits - commits
        mean = (daemon.engine.commits.writes - writes) / max(1, batches)
        for c in conns:
            c.conn.eof_received()
        loop.run_until_complete(asyncio.gather(*(c.session for c in conns)))
        refused = sum(c.transport.refused for c in conns)
        answered = sum(c.transport.answers for c in conns) - clients
        print(f"{answered} submits answered ({refused} not ok), {batches} commits of {mean:.1f} on average, "
              f"{len(daemon.engine.jobs)} jobs queued")
        if refused or answered != warmup + submits:
            return 1
    finally:
        loop.run_until_complete(daemon_main.stop(daemon))
        loop.close()
        shutil.rmtree(base, ignore_errors=True)
    return 0


def outer(args: argparse.Namespace, rest: list[str]) -> int:
    out = tempfile.mkdtemp(prefix="gsi-cg")
    try:
        total, stdout = h.callgrind_instructions([sys.executable, os.path.abspath(__file__), "--inner", *rest], out,
                                                 ["--toggle-collect=sys_call_tracing"])
    except subprocess.CalledProcessError as exc:
        sys.stdout.write(exc.stdout)
        sys.stderr.write(exc.stderr[-4000:])
        return exc.returncode
    finally:
        shutil.rmtree(out, ignore_errors=True)
    sys.stdout.write(stdout)
    print(f"{total / args.submits:,.0f} instructions per submit ({total:,} for {args.submits} submits, "
          f"{args.clients} clients, after {args.warmup} warm-up submits, request_ids: {args.request_ids})")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--submits", type=int, default=2000, help="submits counted")
    parser.add_argument("--warmup", type=int, default=400, help="submits before counting (caches, first batches)")
    parser.add_argument("--clients", type=int, default=16, help="connections, one submit in flight each")
    parser.add_argument("--request-ids", choices=["cli", "random", "none"], default="cli",
                        help="each submit's request_id: as `gpusched submit` makes it (default), 128 random bits, "
                             "or none")
    parser.add_argument("--inner", action="store_true", help="run the driver itself (what valgrind runs)")
    parser.add_argument("--quick", action="store_true", help="the driver alone, 50 submits after 20: a smoke run")
    args = parser.parse_args()
    if args.quick:
        return inner(50, 20, args.clients, args.request_ids)
    if args.inner:
        return inner(args.submits, args.warmup, args.clients, args.request_ids)
    rest = ["--submits", str(args.submits), "--warmup", str(args.warmup), "--clients", str(args.clients),
            "--request-ids", args.request_ids]
    return outer(args, rest)


if __name__ == "__main__":
    sys.exit(main())
