"""The collector is paused while the engine loads its queue (gcpause.py), and only then; what was
loaded is frozen afterwards."""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusched.config import DaemonConfig
from gpusched.core.scheduler import Scheduler
from gpusched.daemon.engine import Engine
from gpusched.daemon.executor import Executor
from gpusched.daemon.main import scheduler_config
from gpusched.daemon.store import Store
from gpusched.gcpause import gc_paused
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

    def requeue_all() -> None:
        seen["requeue"] = gc.isenabled()
        requeue()

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
        gc.unfreeze()
        trace = Path(__file__).parent / "fixtures" / "alibaba-openb-sample.csv"
        run_replay(str(trace), gpus="H100-80GB:2", policies=["fifo-whole"])
        assert gc.get_freeze_count() == 0
        run_replay(str(trace), gpus="H100-80GB:2", policies=["fifo-whole"], freeze_trace=True)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
