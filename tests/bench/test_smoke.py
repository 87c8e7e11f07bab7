"""Smoke runs of the benchmarks: each script runs with `--quick`, exits 0 and prints its figures.

Benchmarks assert nothing about speed (figures live in bench/ and docs/benchmarks.md, not in tests);
this only keeps the scripts from rotting. All three together take well under a minute on 2 cores.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")


def run_quick(script: str, *extra: str) -> str:
    proc = subprocess.run([sys.executable, os.path.join(BENCH, script), "--quick", *extra],
                          capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.timeout(120)
def test_bench_api_quick() -> None:
    out = run_quick("bench_api.py")
    assert "SQLite INSERT+COMMIT" in out
    assert "gpusched submit, 16 concurrent clients" in out
    assert "bare_server.py --checked, 16 concurrent clients" in out and "gpusched = bare_server.py x" in out
    assert "gpuschedd, one COMMIT per submit (single_commit_daemon.py), 16 concurrent clients" in out
    assert "group commit: gpusched = the same daemon committing each submit alone" in out
    assert "submit -> RUNNING" in out
    assert "gpusched submit process p50" in out
    assert "single-commit floor" in out and "x the floor" in out and "daemon CPU us each" in out
    assert "--array 1-1000 accepted in" in out


@pytest.mark.timeout(60)
def test_prune_batches_quick() -> None:
    out = run_quick("prune_batches.py")
    assert "pruning 2000 of 3000 finished jobs, keep 1000" in out
    assert "each batch its own (baseline)" in out and "once per run (the daemon's)" in out
    assert "ratios: a batch's median" in out


@pytest.mark.timeout(120)
def test_bench_footprint_quick() -> None:
    out = run_quick("bench_footprint.py")
    assert "ratio vs empty @ 1000 queued" in out
    assert "ratio vs empty @ 2000 queued" in out
    assert "database MiB" in out


@pytest.mark.timeout(120)
def test_bench_peers_quick() -> None:
    """Peers that are not installed here are skipped by the script itself, which still exits 0."""
    out = run_quick("bench_peers.py")
    lines = [line for line in out.splitlines() if line.startswith(("gpusched ", "gpusched-py ", "tsp ", "slurm "))]
    assert [line.split()[0] for line in lines] == ["gpusched", "gpusched-py", "tsp", "slurm"]
    assert "skipped" not in lines[0], out  # gpusched itself must always be measured
    for line in lines[1:]:
        assert "skipped" in line or line.split()[1].replace(".", "", 1).isdigit(), line
    assert "ratios" in out or "SKIPPED" in out


@pytest.mark.timeout(120)
def test_crash_storm_quick() -> None:
    """Two seeds of submissions with kill -9 restarts; the script itself checks exactly-once storage."""
    out = run_quick("crash_storm.py")
    assert out.rstrip().endswith("PASS"), out
    rows = [line.split() for line in out.splitlines() if line[:1].isdigit()]
    assert {row[0] for row in rows} == {"1", "2"}


def test_spec_memory_quick() -> None:
    out = run_quick("spec_memory.py")
    assert "one value with an astral character" in out and "worst case per held job" in out


@pytest.mark.timeout(120)
def test_bench_cli_quick() -> None:
    out = run_quick("bench_cli.py")
    assert "python -c pass" in out
    for command in ("submit", "queue", "show", "cancel"):
        assert f"  {command}: p50 " in out, out


@pytest.mark.timeout(120)
def test_instructions_submit_quick() -> None:
    """The driver alone (no valgrind): every submit answered ok, in batches of group commit."""
    out = run_quick("instructions_submit.py")
    assert "70 submits answered (0 not ok)" in out, out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("server", ["gpuschedd", "checked"])
def test_instructions_daemon_quick(server: str) -> None:
    """The real daemon (or bench_api's ceiling) without valgrind: every submit answered, the daemon's
    left PENDING."""
    out = run_quick("instructions_daemon.py", "--server", server)
    assert ("50 submits answered, the last PENDING" if server == "gpuschedd" else "50 submits answered") in out, out


@pytest.mark.timeout(120)
def test_bench_request_keys_quick() -> None:
    out = run_quick("bench_request_keys.py")
    for key in ("none", "random", "ordered"):
        assert f"key {key}" in out, out
    assert "x no key" in out
