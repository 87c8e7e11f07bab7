"""Whether a node can ever run a request (unsatisfiable jobs fail at once, with a reason in words)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gpusched.gpu.amd_profiles import AMD_MODELS, PARTITIONS_PER_MODE
from gpusched.gpu.backend import Gpu
from gpusched.gpu.profiles import MODELS
from gpusched.model import MigRequest, PartitionRequest, ShareRequest, WholeRequest

Request = WholeRequest | MigRequest | ShareRequest | PartitionRequest


def offered_profiles(gpu: Gpu) -> set[str]:
    """MIG profiles a GPU's model can host (empty for a model without tables)."""
    model = MODELS.get(gpu.model)
    return {p.name for p in model.profiles} if model is not None else set()


def unsatisfiable_reason(
    request: Request,
    gpus: Sequence[Gpu],
    share_modes: Mapping[str, str] | None = None,
    dynamic: frozenset[int] = frozenset(),
    mode_toggle: bool = False,
) -> str | None:
    """Why this node can never run the request, in words that say what the node has; None if it can.

    `share_modes` (device UUID -> exclusive|mps|timeslice) makes share requests answerable;
    `dynamic` (GPU indices whose MIG layout the scheduler may change) makes a MIG profile
    satisfiable when such a GPU's model offers it, even if no instance of it exists yet; with
    `mode_toggle` the scheduler may also switch their MIG mode, so they count as whole GPUs too.
    """
    modes = share_modes or {}
    whole = [g for g in gpus if not g.mig_enabled or (mode_toggle and g.index in dynamic)]
    if isinstance(request, WholeRequest):
        if request.gpus > len(whole):
            mig_note = f" ({len(gpus) - len(whole)} more are in MIG mode)" if len(whole) < len(gpus) else ""
            return (
                f"asks for {request.gpus} whole GPU(s) but this node has {len(whole)} GPU(s) "
                f"with MIG off{mig_note}"
            )
        return None
    if isinstance(request, PartitionRequest):
        return _partition_reason(request, gpus)
    if isinstance(request, MigRequest):
        amd = [g for g in gpus if g.vendor == "amd"]
        if amd and len(amd) == len(gpus):
            return (f"asks for MIG profile {request.profile} but this node's GPUs are AMD Instinct "
                    f"({', '.join(sorted({g.model for g in amd}))}) logical GPUs, which have no MIG; "
                    "ask for whole logical GPUs with --gpus N (or a time-sliced share where one is configured)")
        offered = sorted({i.profile for g in gpus for i in g.instances})
        if request.profile in offered:
            return None
        dyn = [g for g in gpus if g.index in dynamic and (g.mig_enabled or mode_toggle)]
        if any(request.profile in offered_profiles(g) for g in dyn):
            return None
        have = ", ".join(offered) if offered else "none"
        dyn_note = ""
        if dyn:
            dyn_note = "; dynamic GPUs offer: " + ", ".join(
                sorted({p for g in dyn for p in offered_profiles(g)}))
        return f"asks for MIG profile {request.profile} but this node's MIG instances are: {have}{dyn_note}"
    shared: list[tuple[str, int]] = []  # (what, memory)
    for g in gpus:
        if not g.mig_enabled and modes.get(g.uuid) in ("mps", "timeslice"):
            shared.append((f"GPU {g.index}", g.memory_total_mib))
        for inst in g.instances if g.mig_enabled else ():
            if modes.get(inst.uuid) in ("mps", "timeslice"):
                shared.append((f"{inst.profile} on GPU {g.index}", inst.memory_mib))
    if not shared:
        if gpus and all(g.vendor == "amd" for g in gpus):
            return ("asks for a GPU share but no GPU on this node is configured for sharing; AMD GPUs share only "
                    "time-sliced ([gpus.N] share = \"timeslice\"; there is no MPS on AMD)")
        return "asks for a GPU share but no device on this node is configured for sharing (mps or timeslice)"
    largest = max(m for _, m in shared)
    if request.gpu_mem_mib > largest:
        return (f"asks for a share with {request.gpu_mem_mib} MiB of GPU memory but the largest shared "
                f"device on this node has {largest} MiB")
    return None


def _partition_reason(request: PartitionRequest, gpus: Sequence[Gpu]) -> str | None:
    """A `--partition MODE` job needs AMD GPUs whose model offers MODE, enough of them in that mode
    once the scheduler has changed idle physical GPUs to it (every one of them, at most)."""
    amd = [g for g in gpus if g.vendor == "amd" and g.partition is not None]
    if not amd:
        return "asks for an AMD partition but there are no partitions on NVIDIA; use --mig"
    physical: dict[int, str] = {}
    for g in amd:
        assert g.partition is not None
        physical[g.partition.physical_index] = g.model
    offering = [m for m in physical.values()
                if (am := AMD_MODELS.get(m)) is not None and request.mode in am.compute_modes]
    if not offering:
        return (f"asks for partition mode {request.mode} but this node's AMD GPUs "
                f"({', '.join(sorted(set(physical.values())))}) do not offer it")
    most = len(offering) * PARTITIONS_PER_MODE[request.mode]
    if request.gpus > most:
        return (f"asks for {request.gpus} logical GPU(s) in {request.mode} mode but this node's "
                f"{len(offering)} physical GPU(s) make at most {most} in that mode")
    return None
