"""What the daemon keeps about checkpointed jobs survives restarts, and a damaged record costs nothing else."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusched.daemon.checkpointing import META_KEY, Checkpoints, Saved
from gpusched.daemon.store import Store
from gpusched.gpu.backend import Inventory
from gpusched.gpu.checkpoint import CheckpointError
from gpusched.gpu.simcheckpoint import GPUS_FILE
from gpusched.model import AllocatedDevice, Allocation, JobState
from tests.core.helpers import gpu, job

H100 = (gpu(0), gpu(1), gpu(2, mig=True), gpu(3, "A100-80GB"))  # GPU-0000 .. GPU-0003


def test_the_pinned_devices_survive_a_restart_and_bad_entries_are_dropped(tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = Store(str(tmp_path / "gpusched.db"))
    try:
        damaged = {"7": {"uuids": ["GPU-a", "GPU-b"], "pids": [41, 42]}, "x": {"uuids": ["GPU-c"]},
                   "8": {"uuids": []}, "9": {"uuids": [3]}, "10": ["GPU-d"], "11": {"uuids": ["GPU-e"], "pids": [-1]}}
        store.set_meta(META_KEY, json.dumps(damaged))
        loaded = Checkpoints(store, None)
        assert loaded.saved == {7: Saved(("GPU-a", "GPU-b"), (41, 42))}
        store.set_meta(META_KEY, "{not json")
        assert Checkpoints(store, None).saved == {}
        kept = Checkpoints(store, None)
        kept.saved[3] = Saved(("GPU-z",))
        kept.forget(4)  # unknown: nothing written
        assert store.get_meta(META_KEY) == "{not json"
        kept.forget(3)
        assert Checkpoints(store, None).saved == {}
    finally:
        store.close()


def test_checkpointing_off_or_without_the_program_is_reported_as_off(tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = Store(str(tmp_path / "gpusched.db"))
    try:
        off = Checkpoints.from_config(store, enabled=False, binary=None, timeout_s=5, sim=True, state_dir=str(tmp_path))
        missing = Checkpoints.from_config(store, enabled=True, binary="/nonexistent/cuda-checkpoint", timeout_s=5,
                                          sim=False, state_dir=str(tmp_path))
        sim = Checkpoints.from_config(store, enabled=True, binary=None, timeout_s=5, sim=True, state_dir=str(tmp_path))
        assert (off.enabled, missing.enabled, sim.enabled) == (False, False, True)
    finally:
        store.close()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    opened = Store(str(tmp_path / "gpusched.db"))
    yield opened
    opened.close()


def _on_sim(store: Store, tmp_path: Path, moves: bool | str = "auto") -> Checkpoints:
    made = Checkpoints.from_config(store, enabled=True, binary=None, timeout_s=10, sim=True,
                                   state_dir=str(tmp_path), moves=moves)  # type: ignore[arg-type]
    assert made.enabled
    return made


def test_moves_follow_the_switch_and_on_auto_the_driver(store: Store, tmp_path: Path) -> None:
    auto = _on_sim(store, tmp_path)
    seen = []
    for version in ("550.90.07", "580.65.06", ""):
        auto.observe(Inventory(gpus=H100, driver_version=version))
        seen.append(auto.moves)
    assert seen == [False, True, False]
    assert _on_sim(store, tmp_path, moves=True).moves and not _on_sim(store, tmp_path, moves=False).moves
    off = Checkpoints.from_config(store, enabled=False, binary=None, timeout_s=10, sim=True, state_dir=str(tmp_path),
                                  moves=True)
    assert not off.moves  # nothing is checkpointed, so nothing moves


def test_a_checkpointed_job_resumes_on_its_own_gpus_or_on_any_whole_gpu_of_its_model(store: Store,
                                                                                     tmp_path: Path) -> None:
    inventory = Inventory(gpus=H100, driver_version="580.65.06")
    fixed, moving = _on_sim(store, tmp_path, moves=False), _on_sim(store, tmp_path, moves=True)
    for made in (fixed, moving):
        made.observe(inventory)
        made.saved[5] = Saved(("GPU-0001",), (99,))
    assert fixed.resume_devices(5, inventory) == ("GPU-0001",)
    # Not GPU 2 (MIG on: no whole GPU there) nor GPU 3 (another model: its state cannot go there).
    assert moving.resume_devices(5, inventory) == ("GPU-0001", "GPU-0000")
    assert moving.resume_devices(6, inventory) == ()


def test_the_device_map_pairs_old_and_new_gpus_in_the_jobs_order(store: Store) -> None:
    made = Checkpoints(store, None)
    made.saved[5] = Saved(("GPU-b", "GPU-a"))
    assert made.device_map(5, ["GPU-b", "GPU-a"]) is None  # where it was: a plain restore
    assert made.device_map(5, ["GPU-d", "GPU-c"]) == {"GPU-b": "GPU-d", "GPU-a": "GPU-c"}
    assert list(made.device_map(5, ["GPU-d", "GPU-c"]) or {}) == ["GPU-b", "GPU-a"]
    with pytest.raises(CheckpointError, match="checkpointed on 2 GPU"):
        made.device_map(5, ["GPU-d"])
    assert made.device_map(6, ["GPU-d"]) is None


def test_the_launch_env_and_the_restore_target_survive_a_restart(store: Store) -> None:
    made = Checkpoints(store, None)
    made.saved[5] = Saved(("GPU-a",), (41,), {"CUDA_VISIBLE_DEVICES": "GPU-a"})
    made.restoring_to(5, ["GPU-b"])
    assert json.loads(store.get_meta(META_KEY) or "") == {
        "5": {"uuids": ["GPU-a"], "pids": [41], "env": {"CUDA_VISIBLE_DEVICES": "GPU-a"}, "to": ["GPU-b"]}}
    again = Checkpoints(store, None)
    assert again.saved[5].to == ("GPU-b",) and again.launch_env(5) == {"CUDA_VISIBLE_DEVICES": "GPU-a"}
    store.set_meta(META_KEY, json.dumps({"5": {"uuids": ["GPU-a"], "env": {"X": 1}}, "6": {"uuids": ["GPU-a"],
                                                                                        "to": "GPU-b"}}))
    assert Checkpoints(store, None).saved == {}  # a damaged env or target drops the entry, not the daemon


def test_on_sim_the_program_learns_the_gpus_and_their_models(store: Store, tmp_path: Path) -> None:
    made = _on_sim(store, tmp_path)
    made.observe(Inventory(gpus=H100, driver_version="550.90.07"))
    written = tmp_path / "sim-checkpoint" / GPUS_FILE
    assert json.loads(written.read_text()) == {"GPU-0000": "H100-80GB", "GPU-0001": "H100-80GB",
                                               "GPU-0002": "H100-80GB", "GPU-0003": "A100-80GB"}
    real = Checkpoints(store, None)
    real.observe(Inventory(gpus=H100, driver_version="580.65.06"))
    assert real.driver_version == "580.65.06" and real.sim_dir is None


@pytest.fixture
def process_on_gpu0() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "600"], env={**os.environ, "CUDA_VISIBLE_DEVICES": "GPU-0000"})
    yield proc
    for sig in (signal.SIGCONT, signal.SIGKILL):
        if proc.poll() is None:
            os.kill(proc.pid, sig)
    proc.wait(timeout=10)


def test_checkpoint_then_restore_through_a_map_onto_another_gpu(store: Store, tmp_path: Path,
                                                                process_on_gpu0: subprocess.Popen[bytes]) -> None:
    """The real wrapper and the simulated program: the job moves from GPU 0 to GPU 1; a map onto
    the other model is refused and leaves it checkpointed."""
    made = _on_sim(store, tmp_path, moves=True)
    made.observe(Inventory(gpus=H100, driver_version="580.65.06"))
    pid = process_on_gpu0.pid
    alloc = Allocation(devices=[AllocatedDevice(uuid="GPU-0000", gpu_index=0, kind="gpu")], compute_fraction=1.0,
                       env={"CUDA_VISIBLE_DEVICES": "GPU-0000"})
    running = job(5).model_copy(update={"state": JobState.RUNNING, "pid": pid, "allocation": alloc})

    async def go() -> str:
        await made.checkpoint(running, [pid])
        assert made.tool is not None
        with pytest.raises(CheckpointError, match="invalid argument"):
            await made.restore(running, made.device_map(5, ["GPU-0003"]))
        await made.restore(running, made.device_map(5, ["GPU-0001"]))
        return await made.tool.state(pid)

    assert asyncio.run(go()) == "running"
    record = json.loads((tmp_path / "sim-checkpoint" / f"{pid}.json").read_text())
    assert record["devices"] == ["GPU-0001"] and record["device_map"] == {"GPU-0000": "GPU-0001"}
