"""The CPUs of a NUMA node, from sysfs: how the AMD backend gives a GPU its CPU affinity.

amdsmi names a GPU's NUMA node (`amdsmi_topo_get_numa_node_number`) but, at the version the backend
follows, no CPU list; the kernel publishes each node's CPUs in
`/sys/devices/system/node/node<N>/cpulist`, in the cpuset list format (`0-15,64-79`). That is what
`rocm-smi --showtoponuma` reads as well. NVML gives a CPU mask itself (gpu/nvml_read.py).
"""

from __future__ import annotations

import os

from gpusched.indexlist import parse_index_list

NODE_ROOT = "/sys/devices/system/node"
_MAX_LIST_BYTES = 64 * 1024  # a cpulist of 4,096 CPUs written one by one is about 20 KiB
_MAX_CPUS = 1 << 16  # Linux's NR_CPUS tops out at 8192; room to spare


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """`0-2,5` -> (0, 1, 2, 5), sorted and without repeats; ValueError naming the bad part (an
    empty list is empty)."""
    cpus = sorted(set(parse_index_list(text, "cpulist", _MAX_CPUS)))
    if cpus and cpus[-1] >= _MAX_CPUS:
        raise ValueError(f"cpulist: CPU {cpus[-1]} is not one of 0..{_MAX_CPUS - 1}")
    return tuple(cpus)


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
