"""What the daemon keeps about checkpointed jobs survives restarts, and a damaged record costs nothing else."""

from __future__ import annotations

import json

from gpusched.daemon.checkpointing import META_KEY, Checkpoints
from gpusched.daemon.store import Store


def test_the_pinned_devices_survive_a_restart_and_bad_entries_are_dropped(tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = Store(str(tmp_path / "gpusched.db"))
    try:
        damaged = {"7": {"uuids": ["GPU-a", "GPU-b"], "pids": [41, 42]}, "x": {"uuids": ["GPU-c"]},
                   "8": {"uuids": []}, "9": {"uuids": [3]}, "10": ["GPU-d"], "11": {"uuids": ["GPU-e"], "pids": [-1]}}
        store.set_meta(META_KEY, json.dumps(damaged))
        loaded = Checkpoints(store, None)
        assert loaded.pinned == {7: ("GPU-a", "GPU-b")} and loaded.pids == {7: (41, 42)}
        store.set_meta(META_KEY, "{not json")
        assert Checkpoints(store, None).pinned == {}
        kept = Checkpoints(store, None)
        kept.pinned[3] = ("GPU-z",)
        kept.forget(4)  # unknown: nothing written
        assert store.get_meta(META_KEY) == "{not json"
        kept.forget(3)
        assert Checkpoints(store, None).pinned == {}
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
