"""Whole-process time of the everyday client commands against `python -c pass`, in the same run.

`gpusched submit`, `queue`, `show` and `cancel` each run as a real process (the installed `gpusched`:
the C front where it was built, which sends the plain submit itself and runs the Python program for
the other three) against a real daemon, interleaved with the baseline `python -c pass`, so drift on a
shared machine hits them all alike. The baseline is the part no client code can remove: the
interpreter starting and exiting (with `site`, as the console script's interpreter does; `python -I
-S -c pass` beside it is the interpreter with nothing imported at all). The goal (issue 13) is each
command's p50 at most 3x the baseline's p50. These commands take the fast path (fastpath.py: no
click); the import rows show what that path and the click program each cost before any work. Jobs
stay PENDING behind a blocker that holds every GPU, so no job process competes for CPU; `queue`
lists them all (30 pending jobs and the blocker, in a full run). The packages'
bytecode is compiled first, as an installed package's is, so no run pays for compiling source.

    python bench/bench_cli.py            # 30 runs of each (~20 s on 2 cores)
    python bench/bench_cli.py --quick    # CI smoke (a few seconds)
"""

from __future__ import annotations

import argparse
import sys

import harness as h

from gpusched_cli import front_build
from gpusched_cli.client import Client

GOAL = 3.0  # x python -c pass, p50


def commands(program: str, socket_path: str, show_id: int, cancel_ids: list[int]) -> dict[str, list[str]]:
    """Name -> argv of each timed process; `cancel` takes a fresh pending job on every run."""
    base = [program, "--socket", socket_path]
    return {
        "python -c pass": [sys.executable, "-c", "pass"],
        "python -I -S -c pass": [sys.executable, "-I", "-S", "-c", "pass"],  # nothing imported, no site
        "python -c 'import gpusched_cli.fastpath'": [sys.executable, "-c", "import gpusched_cli.fastpath"],
        "python -c 'import gpusched_cli.main'": [sys.executable, "-c", "import gpusched_cli.main"],  # click's
        "gpusched submit --gpus 1 -- true": [*base, "submit", "--gpus", "1", "--", "true"],
        "gpusched queue": [*base, "queue"],
        f"gpusched show {show_id}": [*base, "show", str(show_id)],
        "gpusched cancel ID": [*base, "cancel", str(cancel_ids.pop())],
    }


def measure(d: h.DaemonProc, runs: int) -> dict[str, list[float]]:
    h.compile_bytecode()
    program = front_build.installed_path()
    with Client(d.socket) as c:
        h.submit_one(c, h.spec(["sleep", "3600"], gpus=8))  # the blocker; cleanup() kills it
        show_id = h.submit_one(c, h.spec(["true"]))
        cancel_ids = [h.submit_one(c, h.spec(["true"])) for _ in range(runs)]
    times: dict[str, list[float]] = {}
    for _ in range(runs):
        for name, argv in commands(program, d.socket, show_id, cancel_ids).items():
            name = "gpusched cancel ID" if name.startswith("gpusched cancel") else name
            times.setdefault(name, []).append(h.time_process(argv))
    return times


def report(times: dict[str, list[float]]) -> bool:
    """Print the table and the ratios; True when every client command is within the goal."""
    runs = len(times["python -c pass"])
    base = h.median(times["python -c pass"])
    print(f"whole-process time ({runs} runs each, interleaved; goal: p50 <= {GOAL:g}x python -c pass)")
    table = h.Table(["command", "p50 ms", "max ms", "x python -c pass"])
    for name, values in times.items():
        table.add(name, 1000 * h.median(values), 1000 * max(values), h.median(values) / base)
    print(table.render())
    print()
    print("ratios:")
    within = True
    for name, values in times.items():
        if not name.startswith("gpusched "):
            continue
        ratio = h.median(values) / base
        within = within and ratio <= GOAL
        verdict = "within" if ratio <= GOAL else "OVER"
        print(f"  {name.split()[1]}: p50 {1000 * h.median(values):.1f} ms = python -c pass "
              f"({1000 * base:.1f} ms) x{ratio:.2f} ({verdict} {GOAL:g}x)")
    return within


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CI smoke: 4 runs of each")
    parser.add_argument("--runs", type=int, default=None, help="runs of each command (default 30, --quick 4)")
    args = parser.parse_args()
    runs = args.runs or (4 if args.quick else 30)

    print(h.machine_line())
    print(f"gpusched: {front_build.describe_installed()}")
    d = h.DaemonProc(h.short_tmpdir("gbc-"))
    try:
        d.start()
        times = measure(d, runs)
        print()
        report(times)  # a figure, not a test: exit 0 either way (tests never assert on timing)
        return 0
    finally:
        d.cleanup()


if __name__ == "__main__":
    sys.exit(main())
