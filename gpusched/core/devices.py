"""The usage of one device (a whole GPU with MIG off, or a MIG instance) and the rules a share must
meet there. placement.py fits requests onto many of them; cluster_sync.py keeps them current.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, TypeAlias

from gpusched.model import Job

ShareMode = Literal["exclusive", "mps", "timeslice"]
NumaKey: TypeAlias = int | tuple[int, ...] | None  # NUMA node, else the CPU-affinity tuple, else None
SHARE_MODES: tuple[str, ...] = ("exclusive", "mps", "timeslice")
MPS_MAX_CLIENTS = 48  # Volta+ client contexts per device; lowered proportionally on MIG (reference §4)
_EPS = 1e-9

def precision_class(precision: str | None) -> str | None:
    """`half` for fp16/bf16, `full` for fp32/tf32, None when the job did not say."""
    if precision in ("fp16", "bf16"):
        return "half"
    if precision in ("fp32", "tf32"):
        return "full"
    return None


def job_env(job: Job) -> dict[str, str]:
    """Environment the placement adds: fp32 jobs get TF32 switched off so they really run fp32."""
    return {"NVIDIA_TF32_OVERRIDE": "0"} if job.spec.precision == "fp32" else {}


@dataclass(frozen=True, slots=True)
class _Client:
    """A share on a device. Frozen: pause and resume replace it, so copies of a device share clients."""

    fraction: float  # compute it uses now: 0 while suspended in place
    mem: int
    uid: int
    prec: str | None
    share: float = 0.0  # compute it was given (what it takes back when it continues)


@dataclass(slots=True)
class DeviceUse:
    """One device (whole GPU with MIG off, or MIG instance) and who is on it."""

    uuid: str
    gpu_index: int
    kind: Literal["gpu", "mig"]
    profile: str | None
    compute_fraction: float  # of the physical GPU: 1.0, or instance SMs / GPU SMs
    memory_mib: int
    mode: str  # exclusive | mps | timeslice
    numa: NumaKey  # the devices that share one are placed together first
    max_clients: int
    mps_owner: int | None = None  # uid of the idle MPS server the snapshot reports, if any
    holder: int | None = None  # job id holding the device exclusively
    holder_prec: str | None = None
    clients: dict[int, _Client] = field(default_factory=dict)
    used_fraction: float = 0.0
    used_mem: int = 0
    # the clients' uids until a client is added or removed (whoever does so resets it): the MPS
    # uid rule asks it of every device, for every share placement
    uids: frozenset[int] | None = None
    # AMD logical GPU: its physical GPU's compute mode (SPX..CPX) and how many logical GPUs that
    # mode makes (a `--partition` job is charged 1/part_count of the physical GPU); None elsewhere
    partition: str | None = None
    part_count: int = 1

    @property
    def idle(self) -> bool:
        return self.holder is None and not self.clients

    @property
    def shared(self) -> bool:
        return self.mode in ("mps", "timeslice")

    def strangers(self, uid: int) -> bool:
        """Is any client another user's?"""
        uids = self.uids
        if uids is None:
            uids = self.uids = frozenset(c.uid for c in self.clients.values())
        return len(uids) > 1 or (len(uids) == 1 and uid not in uids)

    def precs(self) -> set[str]:
        out = {c.prec for c in self.clients.values() if c.prec is not None}
        if self.holder_prec is not None:
            out.add(self.holder_prec)
        return out

    def copy(self) -> DeviceUse:
        return DeviceUse(
            self.uuid, self.gpu_index, self.kind, self.profile, self.compute_fraction, self.memory_mib,
            self.mode, self.numa, self.max_clients, self.mps_owner, self.holder, self.holder_prec,
            dict(self.clients),  # clients are replaced, never changed, so copies may share them
            self.used_fraction, self.used_mem, self.uids, self.partition, self.part_count,
        )


@dataclass(frozen=True, slots=True)
class _Held:
    """What a committed job holds, so release can undo it exactly."""

    uuids: tuple[str, ...]
    shared: bool


def pause_on(dev: DeviceUse, job_id: int) -> None:
    """A share suspended in place, on one device: its compute is free, its memory and slot stay."""
    client = dev.clients.get(job_id)
    if client is not None and client.fraction > 0:
        dev.used_fraction = max(0.0, dev.used_fraction - client.fraction)
        dev.clients[job_id] = _Client(0.0, client.mem, client.uid, client.prec, client.share)


def _mode(value: str | None) -> str:
    return value if value in SHARE_MODES else "exclusive"


def _share_fits(d: DeviceUse, fraction: float, mem: int, uid: int, *, any_uid: bool = False) -> bool:
    if not d.shared or d.holder is not None:
        return False
    if d.used_fraction + fraction > 1 + _EPS or d.used_mem + mem > d.memory_mib:
        return False
    if len(d.clients) >= d.max_clients:
        return False
    return any_uid or not (d.mode == "mps" and d.strangers(uid))

