"""The sections of the daemon's TOML below the top level: `[gpus.N]`, `[fairness]`, `[scheduler]`,
`[mig]`, `[slurm]`. config.py assembles them into DaemonConfig (and re-exports them); each field's
description is what docs/config.md shows (config_doc.py).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

ShareModeName = Literal["exclusive", "mps", "timeslice"]

# The built-in policies by name (gpusched/policies.py maps each to its code); only the first runs in
# gpuschedd, the others are replay baselines. Named here so that reading a config needs no core.
BUILTIN_POLICIES = ("gpusched", "fifo-whole", "fifo-timeslice", "static-mig")
_POLICY_SPEC = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


class GpuConfig(BaseModel):
    """Per-GPU setup: a whole GPU (default), a fixed MIG layout, or a layout the scheduler plans."""

    model_config = ConfigDict(extra="forbid")

    mig: list[str] | Literal["dynamic"] | None = Field(
        default=None,
        description="MIG layout: a fixed list of profiles created at start (e.g. [\"3g.40gb\", \"2g.20gb\"]), or "
        "\"dynamic\" to let the scheduler create and destroy idle instances from demand; the GPU must be in "
        "MIG mode (simulated GPUs are switched on)",
    )
    share: ShareModeName = Field(
        default="exclusive",
        description="how the GPU (or each of its MIG instances) is shared: one job (exclusive), MPS clients with "
        "thread % and pinned-memory caps (mps), or co-resident jobs with memory accounting (timeslice)",
    )
    interactive: bool = Field(
        default=False, description="reserve this GPU (and its instances) for `--class interactive` jobs"
    )


class FairnessSection(BaseModel):
    """`[fairness]`: weights like cgroup cpu.weight; see docs/scheduling.md for the model."""

    model_config = ConfigDict(extra="forbid")

    default_weight: int = Field(default=100, ge=1, le=10000, description="weight of users not listed")
    weights: dict[str, int] = Field(
        default_factory=dict, description="user name or numeric uid (as a string) -> weight 1..10000"
    )
    groups: dict[str, str] = Field(
        default_factory=dict, description="user name or uid -> group; a group's members share its weight"
    )
    group_weights: dict[str, int] = Field(default_factory=dict, description="group -> weight 1..10000")
    batch_quantum_s: float = Field(default=3600.0, gt=0, description="request length behind a batch job's deadline")
    interactive_quantum_s: float = Field(
        default=300.0, gt=0, description="shorter request: earlier deadline for interactive jobs, same share"
    )
    lag_limit_gpu_s: float = Field(
        default=8 * 3600.0, ge=0, description="credit or debt (GPU-seconds at weight 100) kept across idle periods"
    )
    commit_max_s: float = Field(
        default=3600.0, ge=0, description="a start charges its user at once for min(expected run time, this) x its "
        "GPUs; the charge is settled with what the job used when it ends, so weights hold for short jobs too",
    )

    @field_validator("weights", "group_weights")
    @classmethod
    def _weight_range(cls, value: dict[str, int]) -> dict[str, int]:
        for name, weight in value.items():
            if not 1 <= weight <= 10000:
                raise ValueError(f"weight of {name!r} must be in 1..10000, got {weight}")
        return value


class SchedulerSection(BaseModel):
    """`[scheduler]`: the policy, backfill and preemption."""

    model_config = ConfigDict(extra="forbid")

    policy: str = Field(
        default="gpusched", description="the scheduling policy: \"gpusched\" (fair share, the built-in) or a "
        "site's own as \"package.module:Class\", imported from the daemon's Python path and checked at start "
        "(docs/policies.md); changing it takes a restart. The other built-ins (fifo-whole, fifo-timeslice, "
        "static-mig) are replay baselines",
    )
    policy_options: dict[str, Any] = Field(
        default_factory=dict, description="`[scheduler.policy_options]`: a plug-in policy's own settings, handed to "
        "it as `context.options` (the built-in ignores them)",
    )
    backfill: bool = Field(default=True, description="let jobs with --time start in holes that end in time")
    preempt_after_s: float | None = Field(
        default=1800.0, gt=0, description="preempt --requeue jobs for a user below their share (or an interactive "
        "job) that has waited this long; unset: never preempt",
    )
    preempt_min_gain_s: float = Field(
        default=300.0, ge=0, description="preempt only if the waiting job would otherwise wait longer than this"
    )
    preempt_min_run_s: float = Field(default=600.0, ge=0, description="never preempt a job that has run less than this")
    preempt_lag_margin_gpu_s: float = Field(
        default=900.0, ge=0, description="the victim's user must be at least this far (GPU-seconds) above their share"
    )
    preempt_max_per_job: int = Field(default=0, ge=0, description="how often one job may be preempted (0: no cap; "
                                     "preempt_budget_gpu_s bounds the loss)")
    preempt_budget_gpu_s: float = Field(
        default=4 * 3600.0, ge=0, description="work (GPU-seconds) a user's --requeue jobs may lose to preemption "
        "per day; a job whose loss would exceed what is left is not requeued",
    )
    preempt_suspend_shares: bool = Field(
        default=True, description="preempt a share on an MPS or time-sliced device by suspending it in place "
        "(SIGSTOP): it keeps its GPU memory and slot, gives up its compute, and continues when the compute is free "
        "again; nothing is lost",
    )
    interactive_window_s: float = Field(
        default=3600.0, ge=0, description="while interactive jobs were seen this recently, devices are kept for them"
    )
    interactive_headroom_gpus: int = Field(
        default=1, ge=0, le=64, description="most devices kept for interactive work (sized from recent demand); 0: none"
    )
    interactive_headroom_fraction: float = Field(
        default=0.25, ge=0, le=1, description="the headroom is also at most this fraction of the node's GPUs, rounded "
        "down (so a 2- or 3-GPU node keeps none: a kept GPU would block every 2-GPU batch job)",
    )
    interactive_preempt_after_s: float | None = Field(
        default=0.0, ge=0, description="an interactive job that has waited this long may preempt batch work on the "
        "headroom; unset: never",
    )
    mps_across_users: Literal["never", "interactive", "always"] = Field(
        default="interactive", description="whose shares may join an MPS device where another user's MPS server "
        "runs (one server per user; servers time-slice)",
    )
    backfill_unknown_horizon_s: float = Field(
        default=3600.0, ge=0, description="longest --time a job may have to backfill when the head's start is unknown"
    )
    reserve_after_s: float = Field(
        default=0.0, ge=0, description="the next job by fairness holds its future devices against jobs without a "
        "--time only once it has waited this long; 0: at once (strict). A positive value keeps GPUs busy when "
        "running jobs have no time limits, at the price of a bounded extra wait for the head",
    )
    hold_head_after_s: float | None = Field(
        default=None, ge=0, description="a blocked job that is next by fairness and has waited this long keeps its "
        "place and its reservation until it starts, even if another user becomes more owed; unset: never",
    )
    default_runtime_s: float = Field(
        default=3600.0, gt=0, description="run-time estimate of a job nothing is known about (no --time, no history)"
    )
    estimate_history: int = Field(
        default=8, ge=1, le=1000, description="run times remembered per user/command/shape for estimates"
    )
    estimate_elapsed_factor: float = Field(
        default=2.0, ge=1, description="a running job is expected to run at least this many times its elapsed time"
    )
    max_scan: int = Field(default=2000, ge=1, description="pending jobs examined per pass once the fairness head "
                          "is blocked")
    per_user_scan: int = Field(default=8, ge=1, description="jobs of one user examined for backfill per pass")
    max_mig_demand: int = Field(default=16, ge=0, description="blocked MIG jobs turned into instance-creation "
                                "demand per pass")


    @field_validator("policy")
    @classmethod
    def _policy_form(cls, value: str) -> str:
        """The form only: importing the module is the daemon's job at start (gpusched/policies.py)."""
        value = value.strip()
        if value in BUILTIN_POLICIES or _POLICY_SPEC.fullmatch(value):
            return value
        raise ValueError(f"{value!r} is neither a built-in policy ({', '.join(BUILTIN_POLICIES)}) nor of the form "
                         "package.module:Class")


class MigSection(BaseModel):
    """`[mig]`: damping for GPUs with `mig = \"dynamic\"`, so layouts do not thrash; on AMD nodes the same
    settings damp partition mode changes for `--partition` demand (docs/scheduling.md, section 3a)."""

    model_config = ConfigDict(extra="forbid")

    min_idle_s: float = Field(default=300.0, ge=0, description="an idle instance must be idle this long to go "
                              "(AMD: a physical GPU must have had no job this long before its partition mode changes)")
    min_reconfig_interval_s: float = Field(
        default=600.0, ge=0, description="minimum time between reconfigurations that destroy, per GPU "
        "(AMD: between partition mode changes, per physical GPU)"
    )
    toggle_mode: bool = Field(
        default=True, description="a dynamic GPU idle this long may leave MIG mode when the next job by fairness needs "
        "whole GPUs only it can complete, and come back into MIG mode for MIG work (never while anything runs on it)"
    )


class SlurmSection(BaseModel):
    """`[slurm]`: how a node in `mode = "slurm-node"` reaches Slurm (docs/slurm.md)."""

    model_config = ConfigDict(extra="forbid")

    node_name: str | None = Field(
        default=None, description="this node's NodeName in slurm.conf; unset: the short host name (as slurmd uses)"
    )
    scontrol: str = Field(default="scontrol", description="the scontrol program used to drain and resume the node")
    slurm_conf: str | None = Field(
        default=None, description="slurm.conf to use (passed as SLURM_CONF); unset: Slurm's own default"
    )
    timeout_s: float = Field(default=10.0, gt=0, le=300, description="a scontrol call taking longer is abandoned "
                             "and retried on the next check")
