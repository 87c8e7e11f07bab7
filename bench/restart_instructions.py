"""Instructions a restart spends on its queued jobs: callgrind of `Engine.start` over a copied state.

Wall time on a shared 2-core machine moves +-20% between runs of the same code, so a restart's
per-job cost is compared in instructions (docs/benchmarks.md, rounds 12 and 14): a process builds
the engine over a copy of a state holding a blocker (running, all 8 GPUs) and N queued jobs, awaits
`Engine.start` and its first pass (which, over more than engine.HAND_OVER_LATER jobs, comes once the
queue has been handed to the scheduler after the start), and leaves with `os._exit` (the interpreter's final collections
would walk the loaded jobs); the same process stopping before `start` is subtracted (the imports).
`PYTHONHASHSEED=0`, the cyclic collector off from the start, as gpuschedd keeps it. Needs valgrind.

    python bench/restart_instructions.py make /tmp/ri --jobs 10000      # a distinct argv each (--same: one spec)
    python bench/restart_instructions.py measure /tmp/ri                # prints start, without, and the difference
    python bench/restart_instructions.py measure /tmp/ri --keep /tmp/cg # also keeps callgrind.out for annotating
    python bench/restart_instructions.py clean /tmp/ri                  # kills the blocker, removes the folder

Run it with the tree to measure first on PYTHONPATH (and its compiled core built); `make` once,
then `measure` each version over the same state.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import glob
import os
import shutil
import sys
import tempfile

import harness as h

from gpusched.config import DaemonConfig
from gpusched.daemon.engine import Engine
from gpusched.daemon.executor import Executor, kill_recorded_jobs
from gpusched.daemon.startup import build_policy, open_gpu_backend, open_store
from gpusched.model import JobState


def make(folder: str, jobs: int, same: bool) -> None:
    """A daemon's state with a running blocker and `jobs` queued behind it, then the daemon stopped
    (the blocker runs on under its shim, so a restart over a copy adopts it and starts nothing)."""
    from bench_footprint import fill, start_blocker

    d = h.DaemonProc(folder)
    os.makedirs(folder, exist_ok=True)
    d.start()
    start_blocker(d)
    fill(d, jobs, 0, clients=8, steps=1, distinct=not same)
    d.terminate()


async def _load(state_dir: str, start: bool) -> int:
    config = DaemonConfig(socket=os.path.join(state_dir, "unused.sock"), state_dir=state_dir, sim=h.SIM,
                          allow_root_jobs=True, cgroup_root="off")
    backend, _ = open_gpu_backend(config)
    engine = Engine(config, open_store(config), backend, Executor(config.state_dir, launcher=config.launcher),
                    build_policy(config))
    if not start:
        return 0
    passed = asyncio.Event()
    first_pass = engine._pass

    async def pass_then_tell() -> None:
        before = engine.passes
        await first_pass()
        if engine.passes > before:  # (one asked for while a long queue is still being handed over decides nothing)
            passed.set()

    # The first pass runs on the loop task start() made, at its first tick: awaited as an event, not
    # polled, so the loop turns the same number of times however slowly callgrind runs it.
    setattr(engine, "_pass", pass_then_tell)  # noqa: B010 - assigning a method is what mypy refuses
    await engine.start()
    await asyncio.wait_for(passed.wait(), 600)
    return sum(1 for j in engine.jobs.values() if j.state is JobState.PENDING)


def load(state_dir: str, start: bool) -> None:
    """The measured process: the engine built over `state_dir` and (with `start`) started."""
    gc.disable()
    pending = asyncio.run(_load(state_dir, start))
    print(f"pending after start: {pending}", flush=True)
    os._exit(0)


def _instructions(folder: str, start: bool, keep: str | None) -> int:
    """Ir of one `load` under callgrind, over a fresh copy of the state (a start writes to it)."""
    with tempfile.TemporaryDirectory(prefix="gri-") as tmp:
        state = os.path.join(tmp, "state")
        shutil.copytree(os.path.join(folder, "state"), state, symlinks=True)
        total, stdout = h.callgrind_instructions(
            [sys.executable, os.path.abspath(__file__), "load", state, *([] if start else ["--no-start"])], tmp)
        print(stdout.strip(), flush=True)
        if keep is not None:
            os.makedirs(keep, exist_ok=True)
            for path in glob.glob(os.path.join(tmp, "callgrind.out.*")):
                shutil.copy(path, os.path.join(keep, os.path.basename(path) + ("" if start else ".nostart")))
        return total


def measure(folder: str, keep: str | None) -> None:
    with_start = _instructions(folder, True, keep)
    without = _instructions(folder, False, keep)
    print(f"with start {with_start:,}; without {without:,}; Engine.start {(with_start - without) / 1e6:,.1f}M")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["make", "measure", "load", "clean"])
    parser.add_argument("folder", help="the state's folder (make, measure, clean) or a state dir (load)")
    parser.add_argument("--jobs", type=int, default=10_000, help="queued jobs (make)")
    parser.add_argument("--same", action="store_true", help="one spec for every job (make)")
    parser.add_argument("--no-start", action="store_true", help="stop before Engine.start (load)")
    parser.add_argument("--keep", help="copy the callgrind.out files here (measure)")
    args = parser.parse_args()
    if args.action == "make":
        make(args.folder, args.jobs, args.same)
    elif args.action == "measure":
        measure(args.folder, args.keep)
    elif args.action == "load":
        load(args.folder, not args.no_start)
    else:
        kill_recorded_jobs(os.path.join(args.folder, "state"))
        shutil.rmtree(args.folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
