"""gpuschedd: configuration, wiring, signals, sd_notify and graceful shutdown.

`run(config, install_signals=False)` is the embeddable form: tests boot the real daemon inside the
test process on a temporary socket. `cli` is the console entry point.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import shutil
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import click
from pydantic import ValidationError

import gpusched.core
from gpusched import __version__
from gpusched.config import ConfigError, DaemonConfig, describe_errors, load_config
from gpusched.daemon.engine import Engine
from gpusched.daemon.executor import Executor
from gpusched.daemon.metrics import MetricsServer
from gpusched.daemon.sdnotify import sd_notify, systemd_heartbeat
from gpusched.daemon.server import Server, SocketInUse, claim_socket_path
from gpusched.daemon.standing import hand_over
from gpusched.daemon.startup import StartupError as StartupError
from gpusched.daemon.startup import build_policy as build_policy
from gpusched.daemon.startup import check_gpu_configs as check_gpu_configs
from gpusched.daemon.startup import lock_state_dir as lock_state_dir
from gpusched.daemon.startup import open_cgroups as open_cgroups
from gpusched.daemon.startup import open_gpu_backend as open_gpu_backend
from gpusched.daemon.startup import open_store as open_store
from gpusched.daemon.startup import policy_factory as policy_factory
from gpusched.daemon.startup import scheduler_config as scheduler_config
from gpusched.daemon.statelock import StateLock
from gpusched.daemon.store import Store
from gpusched.gcpause import LongLivedHeap
from gpusched.gpu.amd_profiles import AMD_MODEL_KEYS
from gpusched.gpu.backend import GpuBackend, GpuError
from gpusched.gpu.profiles import MODEL_KEYS
from gpusched.policy import Policy
from gpusched.protocol import ReloadResult

log = logging.getLogger("gpusched")


@dataclass
class Daemon:
    """A running daemon's parts, for tests and for a clean stop."""

    config: DaemonConfig
    store: Store
    engine: Engine
    server: Server
    backend: GpuBackend
    stopped: asyncio.Event
    metrics: MetricsServer | None = None  # serving /metrics when metrics_address is set

    @property
    def metrics_port(self) -> int | None:
        """The port /metrics is bound to (the real one when metrics_address asked for port 0)."""
        return self.metrics.port if self.metrics is not None else None

    loader: Callable[[], DaemonConfig] | None = None  # re-reads the config file (SIGHUP, `admin reload`)
    pruner: asyncio.Task[None] | None = None  # deletes finished jobs past their retention (prune_periodically)
    slurm_agent: asyncio.Task[None] | None = None  # mode = "slurm-node": drains/resumes the node in Slurm
    lock: StateLock | None = None  # this daemon's hold on its state directory (statelock.py)

    def request_stop(self) -> None:
        self.stopped.set()

    async def prune(self) -> int:
        """Delete finished jobs past `finished_job_retention_s` or beyond `max_finished_jobs` (the
        database, their job directories and logs), in small batches so the loop keeps serving.
        Jobs a pending or held job names in `--after` are kept. Returns how many were deleted."""
        engine = self.engine
        protect = {d.job_id for job in engine.jobs.values() for d in job.spec.after}
        keep = self.config.max_finished_jobs
        cutoff = self.store.prune_cutoff(keep)  # once: walking `keep` entries per batch stalled the loop
        deleted = 0
        while True:
            ids = self.store.prune_finished(ended_before=engine.clock() - self.config.finished_job_retention_s,
                                            keep=keep, protect=protect, cutoff=cutoff)
            if not ids:
                return deleted
            deleted += len(ids)
            await asyncio.to_thread(_remove_job_files, engine.executor, ids)

    async def reload(self) -> ReloadResult:
        """Re-read the configuration and apply what can change live; keep the old one if the new is bad.

        Weights and quanta take effect by rebuilding the scheduler with what the old one knew (each
        user's place, run-time history, requeue losses, preemption counts), so nobody loses their place.
        A new `scheduler.policy` is checked (it must load) and waits for a restart: the running policy's
        state means nothing to another one. Raises ConfigError (nothing changed) for a bad file.
        """
        if self.loader is None:
            raise ConfigError("this daemon was started without a config file; there is nothing to re-read")
        new = await asyncio.to_thread(self.loader)  # (a file on a slow mount must not stall the loop)
        check_gpu_configs(new, self.engine.inventory)  # before anything changes
        old = self.config
        policy_moved = new.scheduler.policy != old.scheduler.policy
        if policy_moved:
            policy_factory(new)  # one that would not load is refused now, not found out at the next restart
            kept = new.scheduler.model_copy(update={"policy": old.scheduler.policy})
            new = new.model_copy(update={"scheduler": kept})
        changed = [k for k in DaemonConfig.model_fields if getattr(new, k) != getattr(old, k)]
        restart = [k for k in changed if k in RESTART_KEYS]
        live = [k for k in changed if k not in RESTART_KEYS]
        try:  # the keys that wait for a restart keep their old values: the mix must hold together too
            applied = DaemonConfig.model_validate({**new.model_dump(), **{k: getattr(old, k) for k in restart}})
        except ValidationError as exc:
            raise ConfigError(f"the new configuration does not hold together with the settings that keep their "
                              f"values until a restart ({', '.join(restart)}): {describe_errors(exc)}") from None
        if policy_moved:
            restart.append("scheduler.policy")
        engine = self.engine
        # (built before anything changes: policy options it refuses leave the old configuration running)
        rebuilt = build_policy(applied) if {"fairness", "scheduler", "mig"} & set(live) else None
        engine.config = applied
        self.config = applied
        self.server.max_connections = applied.max_connections
        self.server.idle_timeout_s = applied.client_idle_timeout_s
        self.server.read_timeout_s = applied.client_read_timeout_s
        if self.metrics is not None:
            self.metrics.max_connections = applied.metrics_max_connections
        engine.devices.health.auto_resume_after_s = applied.health_auto_resume_s
        if rebuilt is not None:
            hand_over(engine.scheduler, rebuilt)
            engine.scheduler = rebuilt
            engine.requeue_all()
        not_applied: list[str] = []
        if "gpus" in live:
            not_applied = await engine.apply_static_layouts()
        if "job_mapping_dir" in live:
            engine._write_job_mapping()  # the new directory maps the jobs running now, not from the next change
        engine.wake()
        log.info("configuration reloaded: changed %s; needing a restart: %s", live or "nothing", restart or "nothing")
        return ReloadResult(changed=live, restart_needed=restart, not_applied=not_applied)


# Settings bound to resources acquired at start (the socket, the database, the driver, cgroups, the
# metrics listener, the checkpoint tool that checkpointed jobs need to be restored): a reload
# reports them and a restart applies them.
RESTART_KEYS = frozenset({"socket", "state_dir", "sim", "cgroup_root", "metrics_address", "metrics_allow_remote",
                          "mps_control", "launcher", "mode", "checkpoint", "checkpoint_binary",
                          "checkpoint_timeout_s", "checkpoint_moves"})


PRUNE_INTERVAL_S = 60.0


async def prune_periodically(daemon: Daemon) -> None:
    """Finished jobs are kept for a while, not for ever: submit-and-cancel must not grow the disk without bound."""
    while True:
        try:
            deleted = await daemon.prune()
            if deleted:
                log.info("pruned %d finished job(s)", deleted)
        except Exception:  # pruning is housekeeping: log and try again next time
            log.exception("pruning finished jobs failed")
        await asyncio.sleep(PRUNE_INTERVAL_S)


def _remove_job_files(executor: Executor, job_ids: list[int]) -> None:
    for job_id in job_ids:
        shutil.rmtree(executor.job_dir(job_id), ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(executor.log_path(job_id))


async def start(config: DaemonConfig, backend: GpuBackend | None = None, backend_name: str = "",
                loader: Callable[[], DaemonConfig] | None = None) -> Daemon:
    """Boot every part and start serving; raises StartupError with an actionable message (ConfigError
    for a `scheduler.policy` that does not load, before anything else is touched)."""
    factory = policy_factory(config)
    policy = build_policy(config, factory)
    lock = lock_state_dir(config)  # before anything touches the state of a daemon that may be alive
    try:
        return await _start_locked(config, lock, policy, factory.name, backend, backend_name, loader)
    except BaseException:
        lock.release()
        raise


async def _start_locked(config: DaemonConfig, lock: StateLock, policy: Policy, policy_name: str,
                        backend: GpuBackend | None, backend_name: str,
                        loader: Callable[[], DaemonConfig] | None) -> Daemon:
    try:
        claim_socket_path(config.socket)
    except (SocketInUse, OSError) as exc:
        raise StartupError(str(exc)) from None
    if backend is None:
        backend, backend_name = open_gpu_backend(config)
    try:
        inventory = backend.inventory()
    except GpuError:
        inventory = None  # the engine's start reports what the driver says (and logs a layout it cannot apply)
    if inventory is not None:
        check_gpu_configs(config, inventory)  # ConfigError: what the file says this node cannot be
    store = open_store(config)
    executor = Executor(config.state_dir, launcher=config.launcher)
    highest = executor.highest_job_id()
    if store.ids_start_after(highest):
        log.warning("the database's job ids were behind the job files in %s (a restored backup, or a lost "
                    "WAL): new jobs are numbered from %d, so none takes a forgotten job's log", config.state_dir,
                    highest + 1)
    cgroups, cgroup_note = open_cgroups(config)
    executor.open()  # the fork server, once the daemon sits in its own cgroup leaf (cgroups.py)
    if cgroups is None:
        log.warning("per-job cgroups off: %s; CPU affinity only, --mem not enforced", cgroup_note)
    engine = Engine(config, store, backend, executor, policy, cgroups=cgroups)
    engine.cgroup_note = cgroup_note
    stopped = asyncio.Event()
    server = Server(engine, config.socket, backend_name, stopped.set, config.max_connections,
                    config.client_idle_timeout_s, config.client_read_timeout_s)
    await engine.start()  # every job loaded and recovered before the first request is read
    try:
        await server.start()
    except (SocketInUse, OSError) as exc:
        await engine.stop()
        store.close()
        if isinstance(exc, SocketInUse):
            raise StartupError(str(exc)) from None
        raise StartupError(f"socket {config.socket}: cannot listen: {exc.strerror or exc}; check its directory, "
                           "or choose another with --socket") from None
    metrics = None
    if config.metrics_address is not None:
        metrics = MetricsServer(engine, config.metrics_address, backend_name, config.metrics_max_connections)
        try:
            await metrics.start()
        except OSError as exc:
            await server.close()
            await engine.stop()
            store.close()
            raise StartupError(f"metrics_address {config.metrics_address}: cannot listen: {exc.strerror}") from None
    log.info("gpuschedd %s listening on %s (%s backend, %d GPUs, policy %s, %s scheduling core)", __version__,
             config.socket, backend_name, len(engine.inventory.gpus), policy_name,
             "compiled" if gpusched.core.NATIVE else "Python")
    daemon = Daemon(config, store, engine, server, backend, stopped, metrics, loader, lock=lock)
    server.reload = daemon.reload
    daemon.pruner = asyncio.create_task(prune_periodically(daemon), name="gpusched-prune")
    if config.mode == "slurm-node":
        from gpusched.slurm import nodeagent  # only Slurm nodes need it

        daemon.slurm_agent = asyncio.create_task(nodeagent.run(engine, lambda: daemon.config), name="gpusched-slurm")
        log.info("slurm-node mode: Slurm owns the queue; node %s follows gpusched's GPU health",
                 nodeagent.node_name(config))
    return daemon


async def stop(daemon: Daemon) -> None:
    """Stop accepting, finish in-flight requests, persist, release the GPU backend."""
    for task in (daemon.pruner, daemon.slurm_agent):
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if daemon.metrics is not None:
        await daemon.metrics.close()
    await daemon.server.close()
    await daemon.engine.stop()
    daemon.store.close()
    daemon.backend.close()
    if daemon.lock is not None:
        daemon.lock.release()
    log.info("gpuschedd stopped")


async def run(config: DaemonConfig, install_signals: bool = True,
              on_ready: Callable[[Daemon], Awaitable[None]] | None = None,
              loader: Callable[[], DaemonConfig] | None = None) -> int:
    """Serve until SIGTERM/SIGINT (or a `shutdown` request); SIGHUP re-reads the config. Returns the exit code."""
    sd_notify("STATUS=starting: reading GPUs and recovering jobs")
    daemon = await start(config, loader=loader)
    if install_signals:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, daemon.request_stop)
        loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(_reload_on_hup(daemon)))
    sd_notify("READY=1\nSTATUS=serving")
    heartbeat = asyncio.create_task(systemd_heartbeat(daemon.engine), name="gpusched-sd-notify")
    if on_ready is not None:
        await on_ready(daemon)
    await daemon.stopped.wait()
    heartbeat.cancel()
    sd_notify("STOPPING=1\nSTATUS=stopping: running jobs stay with their shims")
    await stop(daemon)
    return 0


async def _freeze_loaded(daemon: Daemon) -> None:
    """The loaded queue lives on, and so do the jobs accepted later: no full collection walks
    them again, bar a sweep once an hour (gcpause.LongLivedHeap). Only the daemon's own process
    does this: a program that embeds `run` keeps its collector as it is.

    The collector was off since `_run_loop` (the engine's own pause ends with its load, and the first
    allocation after it would start a collection of everything loaded, still young: 0.7 s of a
    restart at 100k queued jobs), so it is turned on only once what was loaded is frozen."""
    LongLivedHeap().start()  # and a sweep every SWEEP_INTERVAL_S
    gc.enable()


async def _reload_on_hup(daemon: Daemon) -> None:
    sd_notify("RELOADING=1")
    try:
        await daemon.reload()
    except ConfigError as exc:
        log.error("configuration NOT reloaded, still running on the previous one: %s", exc)
    except Exception:
        log.exception("configuration reload failed; still running on the previous one")
    sd_notify("READY=1")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="TOML config file.")
@click.option("--sim", metavar="MODEL[:COUNT][,...]",
              help="Simulated GPUs instead of the driver, e.g. H100-80GB:2 or A100-40GB:2,H200:2, or AMD "
              f"Instinct MI300X:2. Models: {', '.join(MODEL_KEYS)} (NVIDIA); {', '.join(AMD_MODEL_KEYS)} (AMD); "
              "one vendor per node.")
@click.option("--socket", "socket_path",
              help="Unix socket to listen on [default: /run/gpusched/gpusched.sock as root, else "
                   "$XDG_RUNTIME_DIR/gpusched/gpusched.sock, else /tmp/gpusched-$UID/gpusched.sock].")
@click.option("--state-dir", help="Directory for the database, job records and logs.")
@click.option("--mode", type=click.Choice(["standalone", "slurm-node"]),
              help="slurm-node: Slurm owns the queue (submit is refused); gpusched keeps the GPU layout and health "
              "and drains the node in Slurm on a fault. See docs/slurm.md.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False))
@click.version_option(__version__, prog_name="gpuschedd")
def cli(config_path: str | None, sim: str | None, socket_path: str | None, state_dir: str | None,
        mode: str | None, log_level: str) -> None:
    """gpuschedd: the gpusched daemon.

    Keeps a fair queue of GPU jobs and runs each on a whole GPU, a MIG instance or a share of one.
    Without a GPU, run it on simulated GPUs: gpuschedd --sim H100-80GB:2
    """
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    overrides = {"sim": sim, "socket": socket_path, "state_dir": state_dir, "mode": mode}
    if config_path is not None:
        config_path = os.path.abspath(config_path)
    try:
        config = absolute_paths(load_config(config_path, overrides))
    except ConfigError as exc:
        click.echo(f"gpuschedd: {exc}", err=True)
        sys.exit(2)
    loader = (lambda: absolute_paths(load_config(config_path, overrides))) if config_path is not None else None
    # Nothing of the directory we were started from may matter later (a job's shim must not find a
    # planted module there, and a busy directory must not be held): paths are absolute from here on.
    os.chdir("/")
    try:
        code = _run_loop(config, loader)
    except StartupError as exc:
        click.echo(f"gpuschedd: cannot start: {exc}", err=True)
        sys.exit(1)
    except ConfigError as exc:  # what the file asks of GPUs this node does not have (check_gpu_configs)
        click.echo(f"gpuschedd: {config_path or 'the configuration'}: {exc}", err=True)
        sys.exit(2)
    sys.exit(code)


def absolute_paths(config: DaemonConfig) -> DaemonConfig:
    """Resolve the relative paths a config or command line gave against the starting directory."""
    paths = {"socket": config.socket, "state_dir": config.state_dir, "job_mapping_dir": config.job_mapping_dir}
    return config.model_copy(update={k: os.path.abspath(v) for k, v in paths.items() if v is not None})


def _run_loop(config: DaemonConfig, loader: Callable[[], DaemonConfig] | None) -> int:
    gc.disable()  # until the start's load is frozen (_freeze_loaded): what it loads is not garbage
    try:
        import uvloop
    except ImportError:  # uvloop is a dependency, but a plain asyncio loop is a fine fallback
        return asyncio.run(run(config, loader=loader, on_ready=_freeze_loaded))
    return int(uvloop.run(run(config, loader=loader, on_ready=_freeze_loaded)))


if __name__ == "__main__":
    cli()
