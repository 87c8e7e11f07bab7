"""The core compiled with mypyc (gpusched/native.py) is used only when it matches the sources, and
decides exactly what the pure-Python core decides."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import gpusched.core
import gpusched.core.scheduler
from gpusched import native

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import seed_story  # noqa: E402

compiled = pytest.mark.skipif(not gpusched.core.NATIVE,
                              reason=f"the compiled core is not in use: {native.usable_build()}")


def _manifest(tmp_path: Path, **changes: object) -> Path:
    data = {"abi": sysconfig.get_config_var("EXT_SUFFIX"), "sources": native._sources(), **changes}
    (tmp_path / native.MANIFEST).write_text(json.dumps(data))
    return tmp_path


def test_a_build_of_these_very_sources_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(native.PURE_ENV, raising=False)
    assert native.usable_build(str(_manifest(tmp_path))) is None


def test_a_build_of_other_sources_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An edited source must never run as the stale machine code built from its old text."""
    monkeypatch.delenv(native.PURE_ENV, raising=False)
    sources = native._sources()
    edited = {**sources, "queue.py": "0" * 64}
    assert "other sources" in str(native.usable_build(str(_manifest(tmp_path, sources=edited))))
    added = {**sources, "new_module.py": "0" * 64}  # a module added since the build, or one removed
    assert "other sources" in str(native.usable_build(str(_manifest(tmp_path, sources=added))))


def test_a_build_for_another_python_or_none_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(native.PURE_ENV, raising=False)
    assert "another Python" in str(native.usable_build(str(_manifest(tmp_path, abi=".cpython-312-x.so"))))
    assert "not built" in str(native.usable_build(str(tmp_path / "absent")))
    (tmp_path / native.MANIFEST).write_text("{")
    assert "cannot be read" in str(native.usable_build(str(tmp_path)))


def test_the_environment_switch_keeps_the_compiled_core_out(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.PURE_ENV, "1")
    assert native.PURE_ENV in str(native.usable_build(str(_manifest(tmp_path))))
    path: list[str] = []
    assert native.core_path(path) is False and path == []


@compiled
def test_the_compiled_modules_are_the_ones_imported() -> None:
    assert gpusched.core.scheduler.__file__.endswith(str(sysconfig.get_config_var("EXT_SUFFIX")))


def _replay(args: list[str], pure: bool) -> list[dict[str, object]]:
    env = {k: v for k, v in os.environ.items() if k != native.PURE_ENV}
    if pure:
        env[native.PURE_ENV] = "1"
    out = subprocess.run([sys.executable, "-m", "gpusched_cli.main", "replay", *args, "--json"], capture_output=True,
                         text=True, env=env, timeout=300, check=True, cwd=ROOT)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    for row in rows:
        row.pop("decision_us_mean")  # the one figure that should differ
    return rows


@compiled
@pytest.mark.parametrize("case", ["seed-story", "seed-story-requeue", "alibaba-sample-mig"])
def test_the_compiled_core_decides_what_the_pure_python_core_decides(tmp_path: Path, case: str) -> None:
    """Every figure of a replay (the seed's story: shares, headroom, checkpoint or requeue
    preemption; the Alibaba sample on a MIG-capable node) is the same with either core."""
    if case.startswith("seed-story"):
        args = [seed_story.write_trace(str(tmp_path / "story.csv")), "--gpus", seed_story.GPUS]
        if case.endswith("requeue"):
            (tmp_path / "replay.toml").write_text("[replay]\ncheckpoint = false\n")
            args += ["--config", str(tmp_path / "replay.toml")]
    else:
        (tmp_path / "replay.toml").write_text("[replay]\nmig_gpus = 1\n")
        args = [str(ROOT / "tests" / "fixtures" / "alibaba-openb-sample.csv"), "--gpus", "H100-80GB:2",
                "--config", str(tmp_path / "replay.toml")]
    pure = _replay(args, pure=True)
    assert [r["policy"] for r in pure] == ["gpusched", "fifo-whole", "fifo-timeslice", "static-mig"]
    assert _replay(args, pure=False) == pure


@compiled
def test_the_pure_python_core_passes_the_tests_that_subclass_the_scheduler() -> None:
    """tests/core/test_pass_memos.py checks the scheduler's kept answers from inside a subclass,
    which compiled classes do not allow: here it runs on the pure-Python core."""
    env = {**os.environ, native.PURE_ENV: "1"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                          "tests/core/test_pass_memos.py"], capture_output=True, text=True, env=env, timeout=600,
                         cwd=ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "skipped" not in out.stdout, out.stdout[-2000:]


def test_the_tables_of_queued_jobs_hold_each_jobs_own_id_not_a_copy() -> None:
    """Compiled, `job.id` is a machine integer that each table storing it boxed again: a new int
    object per table per queued job, about 15 MiB of RSS at 100k queued (docs/benchmarks.md, the
    footprint). The pending-job tables keep the job's own object, compiled or not."""
    from gpusched.core.scheduler import Scheduler, SchedulerConfig
    from tests.core.helpers import job

    sched = Scheduler(SchedulerConfig())
    queued = job(10_000_019, submitted=5.0)
    sched.submit(queued)
    queue = sched.queue
    (stored,) = [k for k in queue._jobs if k == queued.id]
    assert stored is queued.id
    assert next(k for k in queue._keys if k == queued.id) is queued.id
    assert queue._keys[queued.id][3] is queued.id
    assert next(k for k in sched._pending_since if k == queued.id) is queued.id
