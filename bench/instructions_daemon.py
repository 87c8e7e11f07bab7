"""The real daemon's instructions per submit, counted by callgrind: uvloop, real sockets, 16 clients.

`instructions_submit.py` counts the request path in-process, on asyncio's own loop and fed through
memory; this counts `gpuschedd` itself as `bench_api` runs it (`python -m gpusched.daemon.main`
on uvloop), its clients in this process sending what `gpusched submit` sends on plain sockets, so
the socket layer (the daemon's `Connection`, uvloop's transports) is counted as it runs. Only user
space is counted (the kernel's socket and fsync work is not), and only the measured submits:
the daemon runs with callgrind's instrumentation off (`--instr-atstart=no`) through its start and
the warm-up submits, and `callgrind_control` turns it on for the measured ones and dumps after them.
Every GPU is drained, so the jobs stay PENDING and nothing is forked.

    python bench/instructions_daemon.py                  # 1600 submits after 400, 16 clients
    python bench/instructions_daemon.py --submits 800 --clients 8
    python bench/instructions_daemon.py --server checked # bench/bare_server.py --checked instead (bare: plain)
    python bench/instructions_daemon.py --quick          # the daemon without valgrind: a smoke run

Needs valgrind (`apt-get install valgrind`, which has `callgrind_control`); PYTHONHASHSEED=0.
Compare two trees with the same arguments. Figures are of the tree the script lies in.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import harness as h
from bench_api import submit_frame

from gpusched_cli.client import Client


def count(submits: int, warmup: int, clients: int, valgrind: bool, server: str = "gpuschedd") -> int:
    """Instructions per submit of `server`: gpuschedd, or bench/bare_server.py (`bare`, `checked`)."""
    folder = h.short_tmpdir("gbi-")
    out = os.path.join(folder, "callgrind.out")
    wrapper = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"] if valgrind else []
    try:
        with contextlib.ExitStack() as stack:
            if server == "gpuschedd":
                d = h.DaemonProc(folder)
                stack.callback(d.cleanup)
                d.start(timeout=300, wrapper=wrapper)
                with Client(d.socket, timeout=300) as c:
                    for gpu in range(8):  # nothing starts: the queue only grows, as behind a long job
                        c.request({"op": "gpu_drain", "device": str(gpu), "reason": "bench"})
                socket_path, pid = d.socket, d.pid
            else:
                bare = stack.enter_context(h.BareServer(folder, checked=server == "checked", wrapper=wrapper))
                socket_path, pid = bare.socket, bare.pid
            h.send_submits_concurrently(socket_path, submit_frame, warmup, clients)
            if valgrind:
                subprocess.run(["callgrind_control", "--instr=on", str(pid)], check=True, capture_output=True)
            _elapsed, ids = h.send_submits_concurrently(socket_path, submit_frame, submits, clients)
            if valgrind:
                subprocess.run(["callgrind_control", "--dump", str(pid)], check=True, capture_output=True)
            queued = None  # the daemon's last job's state (a bare server keeps no states)
            if server == "gpuschedd":
                with Client(socket_path, timeout=300) as c:
                    queued = c.request({"op": "show", "job_id": ids[-1]})["job"]["state"]
            print(f"{len(ids)} submits answered" + (f", the last {queued}" if queued is not None else ""))
            if len(set(ids)) != submits or queued not in (None, "PENDING"):
                return 1
            if not valgrind:
                return 0
            dumps = glob.glob(out + ".*")  # the dump callgrind_control asked for (the exit's comes later)
            if not dumps:
                print("no callgrind dump was written", file=sys.stderr)
                return 1
            total = max(h.callgrind_total(path) for path in dumps)
            print(f"{total / submits:,.0f} {server} instructions per submit ({total:,} for {submits} submits, "
                  f"{clients} clients, after {warmup} warm-up submits)")
            return 0
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> int:
    os.environ["PYTHONHASHSEED"] = "0"  # the daemon's (a fixed hash seed: the same dict layouts run to run)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--submits", type=int, default=1600, help="submits counted")
    parser.add_argument("--warmup", type=int, default=400, help="submits before counting")
    parser.add_argument("--clients", type=int, default=16, help="connections, one submit in flight each")
    parser.add_argument("--server", choices=["gpuschedd", "bare", "checked"], default="gpuschedd",
                        help="what to count: the daemon, or bench/bare_server.py (bench_api's ceiling), plain or "
                        "--checked")
    parser.add_argument("--quick", action="store_true", help="50 submits after 20, without valgrind: a smoke run")
    args = parser.parse_args()
    if args.quick:
        return count(50, 20, args.clients, valgrind=False, server=args.server)
    return count(args.submits, args.warmup, args.clients, valgrind=True, server=args.server)


if __name__ == "__main__":
    sys.exit(main())
