"""Where a submit's time goes inside the daemon: cProfile of the event-loop thread under load.

Not a benchmark (no baseline, no ratio): a diagnostic for the figures in docs/benchmarks.md. The
daemon runs in-process on its own loop thread (as tests/conftest.py boots it), so the profiler sees
every handler, scheduling pass and commit; clients are threads on their own connections.

    python bench/profile_submit.py                       # 4000 queued, then profile 2000 submits
    python bench/profile_submit.py --queued 20000 --top 25
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import sys

import harness as h

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gpusched.protocol import WaitRequest, WaitResult
from gpusched_cli.client import Client
from tests.conftest import DaemonHandle, kill_job_processes, short_tmpdir


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queued", type=int, default=4000, help="pending jobs before profiling starts")
    parser.add_argument("--submits", type=int, default=2000, help="submits profiled")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--top", type=int, default=30, help="rows of the cumulative profile")
    args = parser.parse_args()

    base = short_tmpdir()
    d = DaemonHandle(socket=os.path.join(base, "g.sock"), state_dir=os.path.join(base, "state"), sim=h.SIM,
                     overrides={"allow_root_jobs": True, "cgroup_root": "off"})
    prof = cProfile.Profile()
    d.start()
    try:
        with Client(d.socket) as c:
            h.submit_one(c, h.spec(["sleep", "3600"], gpus=8))
        if args.queued:
            h.submit_concurrently(d.socket, h.spec(["true"]), args.queued, args.clients)
        d.call_in_loop(prof.enable)  # profile the daemon's loop thread only
        elapsed, _ = h.submit_concurrently(d.socket, h.spec(["true"]), args.submits, args.clients)
        d.call_in_loop(prof.disable)
        engine = d.daemon.engine if d.daemon is not None else None
        print(f"{args.submits} submits at {args.submits / elapsed:.0f}/s with {args.queued} queued; "
              f"engine passes so far: {engine.passes if engine else '?'}")
        with Client(d.socket) as c:  # end the blocker through the daemon so its shim finds its job dir
            h.cancel_all(c, [1])
            c.call(WaitRequest(job_id=1, timeout_s=30), WaitResult)
    finally:
        d.stop()
        kill_job_processes(d.state_dir)
        shutil.rmtree(base, ignore_errors=True)
    pstats.Stats(prof).sort_stats("cumulative").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
