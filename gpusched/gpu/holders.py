"""Who holds a MIG instance open: the processes with its capability device file open.

NVML says only "in use" when a destroy is refused, and lists compute processes alone; a monitoring
agent (DCGM's nv-hostengine, NVIDIA/DCGM issues #95 and #276) can keep a GPU or compute instance
busy without being one. The driver exposes each instance's access capability as a device file
`/dev/nvidia-caps/nvidia-cap<minor>`, and `/proc/driver/nvidia-caps/mig-minors` maps
`gpu<N>/gi<G>/access` and `gpu<N>/gi<G>/ci<C>/access` to those minors (NVIDIA MIG user guide, "Device
Nodes and Capabilities"). So the holders are the processes with one of those files open. No NVML.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

MIG_MINORS = "driver/nvidia-caps/mig-minors"
CAPS_DIR = "/dev/nvidia-caps"


@dataclass(frozen=True, slots=True)
class Holder:
    pid: int
    command: str


def _minors(proc: Path, gpu_minor: int, gi_id: int, ci_id: int | None) -> set[int]:
    """Capability minors of the GI (and of the CI, when given) on one GPU."""
    wanted = {f"gpu{gpu_minor}/gi{gi_id}/access"}
    if ci_id is not None:
        wanted.add(f"gpu{gpu_minor}/gi{gi_id}/ci{ci_id}/access")
    try:
        lines = (proc / MIG_MINORS).read_text().splitlines()
    except OSError:
        return set()
    out: set[int] = set()
    for line in lines:
        parts = line.split()
        if len(parts) == 2 and parts[0] in wanted and parts[1].isdigit():
            out.add(int(parts[1]))
    return out


def instance_holders(gpu_minor: int, gi_id: int, ci_id: int | None = None, *, proc_root: str = "/proc") -> list[Holder]:
    """Processes that have the GI's (or CI's) capability file open; [] when none or unreadable.

    Unreadable fds of other users' processes (unprivileged runs) are skipped, so the answer can be
    incomplete but never wrong; callers say "unknown holder" when it is empty.
    """
    proc = Path(proc_root)
    targets = {f"{CAPS_DIR}/nvidia-cap{m}" for m in _minors(proc, gpu_minor, gi_id, ci_id)}
    if not targets:
        return []
    found: list[Holder] = []
    for entry in sorted(proc.iterdir(), key=lambda p: p.name):
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link in targets:
                try:
                    command = (entry / "comm").read_text().strip()
                except OSError:
                    command = "?"
                found.append(Holder(int(entry.name), command))
                break
    return found


def describe(holders: list[Holder]) -> str:
    """`nv-hostengine (pid 812)`, or what we know when nobody was found."""
    if not holders:
        return ("no compute process and no process with the instance's /dev/nvidia-caps file open was "
                "found; another NVML client (DCGM's nv-hostengine is the known case) may hold a handle")
    return "held by " + ", ".join(f"{h.command} (pid {h.pid})" for h in holders)
