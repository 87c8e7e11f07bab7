"""What gpuschedd opens before it serves: the GPU backend, the cgroup subtree for jobs, the pure
core's configuration from the TOML and the policy it names. main.py wires them together (and
re-exports these names).
"""

from __future__ import annotations

import os
import sqlite3

from gpusched.config import ConfigError, DaemonConfig
from gpusched.config_sections import GpuConfig
from gpusched.core.estimate import EstimatorConfig
from gpusched.core.fairshare import FairnessConfig
from gpusched.core.migplan import MigPolicy, layout_error
from gpusched.core.scheduler import SchedulerConfig
from gpusched.daemon.cgroups import CgroupError, CgroupManager, own_cgroup
from gpusched.daemon.safepath import unsafe_reason
from gpusched.daemon.statelock import StateLock, StateLocked
from gpusched.daemon.store import Store, StoreError
from gpusched.gpu.backend import Gpu, GpuBackend, GpuError, Inventory
from gpusched.policies import PolicyError, PolicyFactory, load_policy
from gpusched.policy import Policy, PolicyContext


class StartupError(Exception):
    """The daemon cannot start; the message says why and what to do."""


def lock_state_dir(config: DaemonConfig) -> StateLock:
    """Create the state directory (0711: job owners must reach their own log, STATE/logs/ID.log, but
    may not list anything) and take the one-daemon lock on it. A directory another user owns, or
    may write, on the way is refused (safepath.py)."""
    unsafe = unsafe_reason(config.state_dir, os.geteuid())
    if unsafe is not None:
        raise StartupError(f"state directory {config.state_dir} is not safe to use: {unsafe}; choose another "
                           "with --state-dir (or remove what another user created there)")
    try:
        os.makedirs(config.state_dir, mode=0o711, exist_ok=True)
        os.chmod(config.state_dir, 0o711)
        lock = StateLock(config.state_dir)
        lock.acquire()
    except StateLocked as exc:
        raise StartupError(str(exc)) from None
    except OSError as exc:
        raise StartupError(f"state directory {config.state_dir}: {exc.strerror or exc}") from None
    return lock


def check_gpu_configs(config: DaemonConfig, inventory: Inventory) -> None:
    """Raise ConfigError naming `gpus.N` for a GPU this node does not have, or a fixed layout its
    model can never hold: at start (exit 2) and before a reload changes anything. A GPU that is on
    the node but cannot be read now (`inventory.errors`: lost, failing) has its table kept: one bad
    GPU must not stop the daemon from serving the others, nor every later reload."""
    gpus = {g.index: g for g in inventory.gpus}
    problems = []
    for key, gpu_config in sorted(config.gpus.items(), key=lambda item: int(item[0])):
        gpu = gpus.get(int(key))
        if gpu is None and int(key) in inventory.errors:
            continue  # on the node but unreadable now (lost, or failing): kept for when it is back
        if gpu is None:
            have = sorted(set(gpus) | set(inventory.errors))
            problems.append(f"gpus.{key}: there is no GPU {key} (this node has "
                            f"{'GPU(s) ' + ', '.join(map(str, have)) if have else 'no GPU'})")
        elif gpu.vendor == "amd":
            problems += amd_config_problems(key, gpu, gpu_config)
        elif isinstance(gpu_config.mig, list):
            error = layout_error(gpu.model, gpu_config.mig)
            if error is not None:
                problems.append(f"gpus.{key}.mig: {error}")
    if problems:
        raise ConfigError("; ".join(problems))


def amd_config_problems(key: str, gpu: Gpu, gpu_config: GpuConfig) -> list[str]:
    """What `[gpus.N]` may not say of an AMD Instinct logical GPU: it has no MIG (AMD partitions a GPU
    by compute/memory modes, and each logical GPU is already a GPU of its own) and no MPS (an NVIDIA
    server); shares on it are time-sliced."""
    where = _amd_where(gpu)
    problems = []
    if gpu_config.mig is not None:
        problems.append(f"gpus.{key}.mig: GPU {gpu.index} is {where}; AMD GPUs have no MIG (they are split "
                        "into logical GPUs by their partition mode, and each is scheduled as a whole GPU): "
                        "remove `mig`")
    if gpu_config.share == "mps":
        problems.append(f"gpus.{key}.share: GPU {gpu.index} is {where}; MPS is NVIDIA only: use "
                        "share = \"timeslice\" to share it, or \"exclusive\"")
    return problems


def _amd_where(gpu: Gpu) -> str:
    p = gpu.partition
    if p is None:
        return f"an AMD {gpu.model}"
    return (f"an AMD {gpu.model} logical GPU ({p.compute_mode}/{p.memory_mode}, partition "
            f"{p.index_in_physical} of {p.count} on physical GPU {p.physical_index})")


def open_store(config: DaemonConfig) -> Store:
    """The state database, or a StartupError that says what is wrong with it (never a traceback)."""
    try:
        return Store(config.db_path)
    except (StoreError, OSError) as exc:
        raise StartupError(f"cannot open the state database: {exc}") from None
    except sqlite3.Error as exc:  # not a database, locked by another program, a read-only file system
        raise StartupError(f"cannot open the state database {config.db_path}: {exc}; if the file is damaged, "
                           "restore it from a backup (docs/admin-guide.md)") from None


def open_gpu_backend(config: DaemonConfig) -> tuple[GpuBackend, str]:
    """The simulator of the `--sim` spec's vendor (NVIDIA or AMD; a spec mixing both is refused),
    else the real driver, NVML first, then amdsmi; refuse with a hint naming both if neither works.
    The name is what `gpus`, `doctor` and /metrics show: sim, sim-amdsmi, nvml or amdsmi."""
    from gpusched.gpu.opener import open_gpu

    try:
        return open_gpu(config.sim)
    except GpuError as exc:
        where = "--sim: " if config.sim else ""
        raise StartupError(f"{where}{exc.message}" + (f"\nhint: {exc.hint}" if exc.hint else "")) from None
    except ValueError as exc:
        raise StartupError(f"--sim: {exc}") from None


def scheduler_config(config: DaemonConfig) -> SchedulerConfig:
    """The pure core's knobs, from the TOML sections `[fairness]`, `[scheduler]` and `[mig]`."""
    f = config.fairness
    return SchedulerConfig(
        fairness=FairnessConfig(
            default_weight=f.default_weight, weights=dict(f.weights), groups=dict(f.groups),
            group_weights=dict(f.group_weights), batch_quantum_s=f.batch_quantum_s,
            interactive_quantum_s=f.interactive_quantum_s, lag_limit_gpu_s=f.lag_limit_gpu_s,
            commit_max_s=f.commit_max_s,
        ),
        estimator=EstimatorConfig(default_runtime_s=config.scheduler.default_runtime_s,
                                  history=config.scheduler.estimate_history,
                                  elapsed_factor=config.scheduler.estimate_elapsed_factor),
        hold_head_after_s=config.scheduler.hold_head_after_s,
        mig=MigPolicy(min_idle_s=config.mig.min_idle_s, min_reconfig_interval_s=config.mig.min_reconfig_interval_s,
                      toggle_mode=config.mig.toggle_mode),
        preempt_after_s=config.scheduler.preempt_after_s,
        preempt_min_gain_s=config.scheduler.preempt_min_gain_s,
        preempt_min_run_s=config.scheduler.preempt_min_run_s,
        preempt_lag_margin_gpu_s=config.scheduler.preempt_lag_margin_gpu_s,
        preempt_max_per_job=config.scheduler.preempt_max_per_job,
        preempt_budget_gpu_s=config.scheduler.preempt_budget_gpu_s,
        preempt_suspend_shares=config.scheduler.preempt_suspend_shares,
        interactive_window_s=config.scheduler.interactive_window_s,
        interactive_headroom_gpus=config.scheduler.interactive_headroom_gpus,
        interactive_headroom_fraction=config.scheduler.interactive_headroom_fraction,
        interactive_preempt_after_s=config.scheduler.interactive_preempt_after_s,
        mps_across_users=config.scheduler.mps_across_users,
        backfill=config.scheduler.backfill,
        backfill_unknown_horizon_s=config.scheduler.backfill_unknown_horizon_s,
        reserve_after_s=config.scheduler.reserve_after_s,
        max_scan=config.scheduler.max_scan,
        per_user_scan=config.scheduler.per_user_scan,
        max_mig_demand=config.scheduler.max_mig_demand,
    )


def policy_factory(config: DaemonConfig) -> PolicyFactory:
    """`[scheduler] policy`, imported and checked: ConfigError naming `scheduler.policy` (exit 2 at
    start, a refused reload) for one that does not load or that gpuschedd cannot run."""
    try:
        factory = load_policy(config.scheduler.policy, field="scheduler.policy")
    except PolicyError as exc:
        raise ConfigError(str(exc)) from None
    why_not = factory.why_not_daemon()
    if why_not is not None:
        raise ConfigError(why_not)
    return factory


def build_policy(config: DaemonConfig, factory: PolicyFactory | None = None) -> Policy:
    """A new instance of the configured policy, built with the core's knobs and
    `[scheduler.policy_options]` (gpusched/policy.py, PolicyContext); ConfigError as policy_factory."""
    factory = factory if factory is not None else policy_factory(config)
    try:
        return factory.make(PolicyContext(scheduler_config(config), dict(config.scheduler.policy_options)))
    except PolicyError as exc:
        raise ConfigError(str(exc)) from None


def open_cgroups(config: DaemonConfig) -> tuple[CgroupManager | None, str]:
    """The delegated cgroup subtree to put jobs in, or None and the reason there is none."""
    if config.cgroup_root == "off":
        return None, 'disabled by cgroup_root = "off"'
    root = config.cgroup_root
    if root == "auto":
        # Only a systemd service with Delegate=yes owns its subtree; anywhere else (a shell, a test,
        # a container's root cgroup) writing there would disturb cgroups that are not ours.
        own = own_cgroup()
        if own is None or "INVOCATION_ID" not in os.environ:
            return None, "not running as a systemd service with Delegate=yes"
        root = os.path.dirname(own) if os.path.basename(own) == "daemon" else own
        if not root.endswith(".service"):
            return None, f"own cgroup {own} is not a service's delegated subtree"
    manager = CgroupManager(root)
    try:
        manager.setup(os.getpid())
    except CgroupError as exc:
        return None, str(exc)
    return manager, f"per-job cgroups under {root} ({', '.join(manager.controllers) or 'no controllers'})"
