"""The collector is paused while the engine loads its queue (gcpause.py), and only then; what was
loaded is frozen afterwards."""

from __future__ import annotations

import asyncio
import gc
import os
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusched.config import DaemonConfig
from gpusched.core.scheduler import Scheduler
from gpusched.daemon.engine import Engine
from gpusched.daemon.executor import Executor
from gpusched.daemon.main import scheduler_config
from gpusched.daemon.store import Store
from gpusched.gcpause import LongLivedHeap, gc_paused
from gpusched.gpu.nvml import open_backend
from gpusched.model import JobSpec, WholeRequest


@pytest.fixture
def collector_on() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_paused_inside_and_restored_after_even_on_error(collector_on: None) -> None:
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("a load that fails")
    assert gc.isenabled()


def test_a_collector_turned_off_by_the_embedder_stays_off(collector_on: None) -> None:
    gc.disable()
    with gc_paused():
        pass
    assert not gc.isenabled()


def test_engine_loads_and_requeues_with_the_collector_paused(tmp_path: Path, collector_on: None) -> None:
    config = DaemonConfig(socket=str(tmp_path / "g.sock"), state_dir=str(tmp_path / "state"), sim="H100-80GB:1",
                          cgroup_root="off", allow_root_jobs=True)
    os.makedirs(config.state_dir)
    store = Store(config.db_path)
    spec = JobSpec(argv=["true"], cwd="/", request=WholeRequest(gpus=1))
    for i in range(3):
        store.submit(uid=0, gid=0, user="root", spec=spec, now=1000.0 + i)
    engine = Engine(config, store, open_backend(config.sim), Executor(config.state_dir),
                    Scheduler(scheduler_config(config), incremental=True))
    seen: dict[str, bool] = {}
    load, requeue = store.jobs_in, engine.requeue_all

    def jobs_in(*args: object, **kwargs: object) -> object:
        seen["load"] = gc.isenabled()
        return load(*args, **kwargs)  # type: ignore[arg-type]

    def requeue_all(**kwargs: bool) -> None:
        seen["requeue"] = gc.isenabled()
        requeue(**kwargs)

    store.jobs_in = jobs_in  # type: ignore[method-assign,assignment]
    engine.requeue_all = requeue_all  # type: ignore[method-assign]

    async def go() -> None:
        await engine.start()
        try:
            assert gc.isenabled()  # serving with the collector on
            assert len(engine.jobs) == 3
        finally:
            await engine.stop()

    asyncio.run(go())
    store.close()
    assert seen == {"load": False, "requeue": False}


def test_the_daemon_process_freezes_what_it_loaded_and_replay_only_when_asked(tmp_path: Path) -> None:
    """gpuschedd's own entry point freezes after the start (an embedder of `run` does not), and a
    replay freezes its trace only for a process that only replays (the CLI passes freeze_trace)."""
    from gpusched.daemon import main
    from gpusched.replay.runner import run_replay

    gc.unfreeze()
    try:
        asyncio.run(main._freeze_loaded(None))  # type: ignore[arg-type]
        assert gc.get_freeze_count() > 0
        assert any(isinstance(getattr(cb, "__self__", None), LongLivedHeap) for cb in gc.callbacks)
        _stop_heaps()  # the daemon's stays for its life; this test process must not keep it
        gc.unfreeze()
        trace = Path(__file__).parent / "fixtures" / "alibaba-openb-sample.csv"
        run_replay(str(trace), gpus="H100-80GB:2", policies=["fifo-whole"])
        assert gc.get_freeze_count() == 0
        run_replay(str(trace), gpus="H100-80GB:2", policies=["fifo-whole"], freeze_trace=True)
        assert gc.get_freeze_count() > 0
        # it froze what survived full collections during the replay, and stopped when the replay did
        assert not any(isinstance(getattr(cb, "__self__", None), LongLivedHeap) for cb in gc.callbacks)
    finally:
        _stop_heaps()
        gc.unfreeze()


def test_the_daemon_entry_point_freezes_on_either_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """_run_loop hands `run` the freeze both with uvloop (the daemon's usual loop) and without it."""
    import builtins
    import sys

    from gpusched.daemon import main

    seen: list[object] = []

    async def fake_run(config: object, *, loader: object = None, on_ready: object = None) -> int:
        seen.append(on_ready)
        return 0

    monkeypatch.setattr(main, "run", fake_run)
    config = DaemonConfig(sim="H100-80GB:1", socket="/nonexistent/g.sock", state_dir="/nonexistent")
    assert main._run_loop(config, None) == 0  # uvloop is installed: its path
    real_import = builtins.__import__

    def no_uvloop(name: str, *args: object, **kwargs: object) -> object:
        if name == "uvloop":
            raise ImportError("no uvloop here")
        return real_import(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.delitem(sys.modules, "uvloop", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_uvloop)
    assert main._run_loop(config, None) == 0  # the plain asyncio fallback
    assert seen == [main._freeze_loaded, main._freeze_loaded]


def test_the_daemon_entry_point_keeps_the_collector_off_until_the_load_is_frozen(
        monkeypatch: pytest.MonkeyPatch, collector_on: None) -> None:
    """The first allocation after the engine's pause would start a collection of everything loaded
    (all of it young); the daemon's own process keeps the collector off from `_run_loop` until
    `_freeze_loaded` has frozen the load, and only then turns it on."""
    from gpusched.daemon import main

    seen: dict[str, object] = {}

    async def fake_run(config: object, *, loader: object = None, on_ready: object = None) -> int:
        seen["during start"] = gc.isenabled()
        assert callable(on_ready)
        gc.unfreeze()
        loaded = [[i] for i in range(1000)]  # what a start loads, while the collector is off
        await on_ready(None)
        seen["after ready"] = gc.isenabled()
        seen["frozen"] = gc.get_freeze_count() >= len(loaded)
        return 0

    monkeypatch.setattr(main, "run", fake_run)
    config = DaemonConfig(sim="H100-80GB:1", socket="/nonexistent/g.sock", state_dir="/nonexistent")
    try:
        assert main._run_loop(config, None) == 0
    finally:
        _stop_heaps()
        gc.unfreeze()
    assert seen == {"during start": False, "after ready": True, "frozen": True}


class _Node:
    """An object in a reference cycle (with itself), so only the cyclic collector can free it."""

    def __init__(self) -> None:
        self.me = self


def test_what_survives_a_full_collection_is_frozen_and_a_sweep_reclaims_frozen_cycles(collector_on: None) -> None:
    heap = LongLivedHeap()

    async def main() -> None:
        heap.start()
        try:
            loaded = gc.get_freeze_count()
            assert loaded > 0  # what was there at the start
            kept = [[i] for i in range(10_000)]  # jobs accepted later: they live on
            gc.collect()
            assert heap.frozen_after_full == 1
            assert gc.get_freeze_count() >= loaded + len(kept)  # the next full collection will not walk them
            node = _Node()
            gone = weakref.ref(node)
            gc.collect()  # frozen while still in use...
            del node  # ...then dropped: a cycle, so reference counting cannot free it
            gc.collect()
            assert gone() is not None  # the collector does not walk frozen objects
            heap.sweep()
            assert gone() is None and heap.sweeps == 1
            assert gc.get_freeze_count() >= len(kept)  # and what lives on is frozen again
        finally:
            heap.stop()
            gc.unfreeze()

    asyncio.run(main())
    assert heap._after_collection not in gc.callbacks


def _stop_heaps() -> None:
    for cb in list(gc.callbacks):
        if isinstance(getattr(cb, "__self__", None), LongLivedHeap):
            gc.callbacks.remove(cb)
