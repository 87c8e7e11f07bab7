"""The CPUs of a NUMA node, from sysfs: how the AMD backend gives a GPU its CPU affinity.

amdsmi names a GPU's NUMA node (`amdsmi_topo_get_numa_node_number`) but, at the version the backend
follows, no CPU list; the kernel publishes each node's CPUs in
`/sys/devices/system/node/node<N>/cpulist`, in the cpuset list format (`0-15,64-79`). That is what
`rocm-smi --showtoponuma` reads as well. NVML gives a CPU mask itself (gpu/nvml_read.py).
"""

from __future__ import annotations

import os

NODE_ROOT = "/sys/devices/system/node"
_MAX_LIST_BYTES = 64 * 1024  # a cpulist of 4,096 CPUs written one by one is about 20 KiB
_MAX_CPU = 1 << 16


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """`0-2,5` -> (0, 1, 2, 5); ValueError naming the bad part (an empty list is empty)."""
    cpus: set[int] = set()
    for part in (p.strip() for p in text.strip().split(",")):
        if not part:
            continue
        first, sep, last = part.partition("-")
        try:
            lo, hi = int(first), int(last) if sep else int(first)
        except ValueError:
            raise ValueError(f"cpu list: {part!r} is not a CPU number or a range") from None
        if not 0 <= lo <= hi < _MAX_CPU:
            raise ValueError(f"cpu list: {part!r} is not a range of CPUs 0..{_MAX_CPU - 1}")
        cpus.update(range(lo, hi + 1))
    return tuple(sorted(cpus))


def sysfs_node_cpus(node: int, root: str = NODE_ROOT) -> tuple[int, ...]:
    """The CPUs of NUMA node `node`; () when the kernel has no such node or it cannot be read (the
    GPU's affinity is then unknown, which `gpusched doctor` reports)."""
    if node < 0:
        return ()
    try:
        with open(os.path.join(root, f"node{node}", "cpulist"), encoding="ascii") as f:
            return parse_cpu_list(f.read(_MAX_LIST_BYTES))
    except (OSError, ValueError, UnicodeDecodeError):
        return ()
