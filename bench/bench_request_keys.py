"""What a submit's request_id costs the store, by the shape of the key: SQLite alone, no daemon.

The daemon keeps each user's request_ids in `submit_keys`, whose primary key (uid, key) is an index
(gpusched/daemon/schema.py). A COMMIT of a group of submits writes each key into that index: keys
made in increasing order (what `gpusched submit` sends since round 18: the time in nanoseconds, then
64 random bits) land together at the end of it, random keys (128 random bits, as before) each on a
page of their own, which the COMMIT writes to the WAL and fsyncs. This replays that write: rows
like the daemon's job rows, `--batch` to a COMMIT at synchronous=FULL, on a table already holding
`--kept` jobs, without a key (the baseline, measured in the same run), with random keys, and with
ordered ones; it prints microseconds of wall and CPU per submit and the ratio to the baseline.

    python bench/bench_request_keys.py
    python bench/bench_request_keys.py --kept 100000 --submits 20000 --batch 16
    python bench/bench_request_keys.py --quick         # its smoke run (tests/bench/test_smoke.py)
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import harness as h

from gpusched_cli.resubmit import new_request_id

KEYS: dict[str, Callable[[], str] | None] = {"none": None, "random": h.random_request_id, "ordered": new_request_id}
SPEC = '{"argv":["python","train.py"],"cwd":"/home/alice/sweep","request":{"kind":"whole","gpus":1}}' + " " * 300


def replay(directory: str, key: Callable[[], str] | None, kept: int, submits: int, batch: int) -> tuple[float, float]:
    """(wall us, CPU us) per submit of `submits` written `batch` to a COMMIT after `kept` others."""
    path = os.path.join(directory, f"keys-{time.monotonic_ns()}.db")
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("CREATE TABLE jobs (id INTEGER PRIMARY KEY AUTOINCREMENT, uid INTEGER, spec TEXT, state TEXT)")
        db.execute("CREATE INDEX jobs_state ON jobs(state)")
        db.execute("CREATE TABLE submit_keys (uid INTEGER NOT NULL, key TEXT NOT NULL, job_id INTEGER NOT NULL, "
                   "PRIMARY KEY (uid, key))")

        def submit() -> None:
            job = db.execute("INSERT INTO jobs (uid, spec, state) VALUES (1000, ?, 'PENDING')", (SPEC,)).lastrowid
            if key is not None:
                db.execute("INSERT INTO submit_keys (uid, key, job_id) VALUES (1000, ?, ?)", (key(), job))

        db.execute("BEGIN")
        for _ in range(kept):
            submit()
        db.execute("COMMIT")
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(submits // batch):
            db.execute("BEGIN IMMEDIATE")
            for _ in range(batch):
                submit()
            db.execute("COMMIT")
        done = submits // batch * batch
        return 1e6 * (time.perf_counter() - wall) / done, 1e6 * (time.process_time() - cpu) / done
    finally:
        db.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kept", type=int, default=40_000, help="jobs (and keys) in the tables before")
    parser.add_argument("--submits", type=int, default=14_000, help="submits timed")
    parser.add_argument("--batch", type=int, default=14, help="submits per COMMIT (group commit)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; the median is printed")
    parser.add_argument("--dir", default=None, help="where the databases go (default: a temporary folder)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: small tables, one round")
    args = parser.parse_args()
    if args.quick:
        args.kept, args.submits, args.rounds = 500, 280, 1
    directory = tempfile.mkdtemp(prefix="gs-keys", dir=args.dir)
    try:
        figures: dict[str, list[tuple[float, float]]] = {name: [] for name in KEYS}
        for _ in range(args.rounds):
            for name, key in KEYS.items():
                figures[name].append(replay(directory, key, args.kept, args.submits, args.batch))
    finally:
        shutil.rmtree(directory, ignore_errors=True)

    base_wall, base_cpu = (h.median([f[i] for f in figures["none"]]) for i in (0, 1))
    print(f"{args.submits} submits, {args.batch} per COMMIT, after {args.kept} kept; median of {args.rounds} rounds")
    for name in KEYS:
        wall, cpu = (h.median([f[i] for f in figures[name]]) for i in (0, 1))
        print(f"  key {name:8s} {wall:6.1f} us wall ({wall / base_wall:.2f}x no key)  "
              f"{cpu:6.1f} us CPU ({cpu / base_cpu:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
