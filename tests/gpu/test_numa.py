"""The CPUs of a NUMA node from sysfs (gpu/numa.py), against a temporary directory laid out like
/sys/devices/system/node, and the AMD backend's CPU affinity built from them."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpusched.gpu.amdsmi import AmdSmiBackend, open_amd_backend
from gpusched.gpu.numa import parse_cpu_list, sysfs_node_cpus
from gpusched.gpu.simamdsmi import SimAmdSmi


@pytest.mark.parametrize(("text", "cpus"), [
    ("0-3\n", (0, 1, 2, 3)),
    ("0-1,64-65", (0, 1, 64, 65)),
    ("5", (5,)),
    ("3,1,2-3", (1, 2, 3)),
    ("\n", ()),  # a memory-only node has no CPUs
])
def test_parse_cpu_list(text: str, cpus: tuple[int, ...]) -> None:
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize(("text", "part"), [("0-x", "'0-x'"), ("4-2", "'4-2'"), ("-1", "'-1'"),
                                            ("0-99999999", "'0-99999999'"), ("100000", "CPU 100000"),
                                            ("1_0", "'1_0'")])
def test_parse_cpu_list_names_the_bad_part(text: str, part: str) -> None:
    with pytest.raises(ValueError, match=part):
        parse_cpu_list(text)


def test_sysfs_node_cpus_reads_the_nodes_cpulist(tmp_path: Path) -> None:
    (tmp_path / "node0").mkdir()
    (tmp_path / "node0" / "cpulist").write_text("0-7,16-23\n")
    (tmp_path / "node1").mkdir()
    (tmp_path / "node1" / "cpulist").write_text("garbage\n")
    assert sysfs_node_cpus(0, str(tmp_path)) == (*range(8), *range(16, 24))
    assert sysfs_node_cpus(1, str(tmp_path)) == ()  # unreadable: affinity unknown, not an error
    assert sysfs_node_cpus(2, str(tmp_path)) == ()  # no such node
    assert sysfs_node_cpus(-1, str(tmp_path)) == ()  # amdsmi's "no NUMA node"


def test_amd_gpus_get_the_cpus_of_their_numa_node() -> None:
    inv = open_amd_backend("MI300X:2@CPX").inventory()
    by_node = {g.numa_node: g.cpu_affinity for g in inv.gpus}
    assert by_node == {0: tuple(range(32)), 1: tuple(range(32, 64))}  # 64 simulated CPUs, two nodes
    assert all(g.cpu_affinity == by_node[g.numa_node] for g in inv.gpus)


def test_the_backend_asks_the_injected_source_per_gpu_node() -> None:
    asked: list[int] = []

    def cpus(node: int) -> tuple[int, ...]:
        asked.append(node)
        return (100 + node,)

    inv = AmdSmiBackend(SimAmdSmi(["MI300X", "MI300X"]), node_cpus=cpus).inventory()
    assert [g.cpu_affinity for g in inv.gpus] == [(100,), (101,)] and sorted(set(asked)) == [0, 1]
