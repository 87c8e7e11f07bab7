"""What a replay node of AMD Instinct GPUs (`--gpus MI300X:8`) changes next to an NVIDIA one.

Each simulated MI300X / MI325X starts in its boot mode (SPX/NPS1: one logical GPU of 304 CUs), so a
node of N of them has N whole GPUs, run through the real AmdSmiBackend over SimAmdSmi as the daemon
runs them. They have no MIG, no MPS and no cuda-checkpoint, hence:
- `static-mig` is skipped (fixed MIG layouts have no AMD meaning; a fixed partition mode is a
  different node, which the replay does not build yet);
- `gpusched` serves shares time-sliced (`[replay] share_mode` unset means mps on NVIDIA, timeslice
  on AMD; "mps" on an AMD node is refused), never with dynamic MIG, and preempts by requeueing;
- MIG rows of a trace are bad rows on an AMD node.
docs/replay.md, "AMD Instinct nodes", says the same for users.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpusched.gpu.amd_profiles import AMD_MODELS
from gpusched.gpu.opener import mixed_vendors
from gpusched.gpu.profiles import MODELS, get_model
from gpusched.replay.replayconfig import ReplayConfigError


class PolicySkipped(Exception):
    """A policy that has no meaning on this node; the replay reports it with its reason, runs the rest."""

    def __init__(self, policy: str, reason: str) -> None:
        super().__init__(f"{policy}: {reason}")
        self.policy = policy
        self.reason = reason


def is_amd(models: Sequence[str]) -> bool:
    return any(m in AMD_MODELS for m in models)


def check_model(name: str) -> None:
    """ValueError naming both vendors' models for a model neither knows."""
    if name in AMD_MODELS:
        return
    try:
        get_model(name)
    except ValueError as err:
        raise ValueError(f"{err}; AMD Instinct: {', '.join(AMD_MODELS)}") from None


def check_one_vendor(spec: str, models: Sequence[str]) -> None:
    """A node runs one backend: a `--gpus` spec mixing NVIDIA and AMD models is refused."""
    mixed = mixed_vendors(list(models))
    if mixed is not None:
        raise ValueError(f"--gpus {spec!r} {mixed}, so replay one vendor at a time")


def gpu_memory_mib(model: str) -> int:
    """A whole GPU's memory: the NVIDIA table's, or an AMD GPU's in its boot mode (SPX/NPS1)."""
    amd = AMD_MODELS.get(model)
    if amd is not None:
        return amd.memory_per_partition_mib(amd.boot_compute, amd.boot_memory)
    return MODELS[model].memory_mib


def offered_profiles(models: Sequence[str]) -> set[str]:
    """MIG profiles the node's models offer (none on AMD)."""
    return {p.name for m in set(models) if m in MODELS for p in MODELS[m].profiles}


def skip_reason(policy: str, models: Sequence[str]) -> str | None:
    """Why a built-in policy does not run on this node, or None."""
    if policy == "static-mig" and is_amd(models):
        return (f"{', '.join(sorted(set(models)))} has no MIG, so fixed MIG layouts have no meaning; "
                "AMD's counterpart, a fixed partition mode, is not replayed yet")
    return None


def share_mode(configured: str | None, models: Sequence[str], source: str = "config") -> str:
    """gpusched's share mode on the node: the config's, else mps on NVIDIA and timeslice on AMD."""
    if not is_amd(models):
        return configured or "mps"
    if configured == "mps":
        raise ReplayConfigError(f"{source}: [replay] share_mode = \"mps\": MPS is NVIDIA only and the node is AMD "
                         f"({', '.join(sorted(set(models)))}); use \"timeslice\" or leave it unset")
    return "timeslice"
