"""Parsing what scontrol prints and what an administrator types for relayout."""

from __future__ import annotations

import pytest

from gpusched.slurm.relayout import _same_gres, parse_layout
from gpusched.slurm.scontrol import SlurmError, parse_node

# `scontrol show node n2 --oneliner` from Slurm 22.05.8 (Debian 12), drained by gpusched.
DRAINED = ("NodeName=n2 Arch=x86_64 CoresPerSocket=1 CPUAlloc=1 CPUEfctv=2 CPUTot=2 CPULoad=0.10 "
           "AvailableFeatures=(null) ActiveFeatures=(null) Gres=gpu:1g.10gb:1,gpu:4g.40gb:1 NodeAddr=127.0.0.1 "
           "NodeHostName=vm Port=40000 Version=22.05.8 OS=Linux 6.1.0 RealMemory=1 AllocMem=0 FreeMem=20000 "
           "Sockets=1 Boards=1 State=MIXED+DRAIN ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A "
           "Partitions=gpu CfgTRES=cpu=2,mem=1M,billing=2,gres/gpu=2 AllocTRES=cpu=1,gres/gpu=1 "
           "CapWatts=n/a CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s "
           "Reason=gpusched: XID 79 on GPU 0; reason=x [root@2026-11-30T16:45:00]\n")


def test_show_node_fields_with_a_reason_that_has_spaces_and_equals() -> None:
    node = parse_node("n2", DRAINED)
    assert node.state == "MIXED+DRAIN" and node.drain and node.gpus_allocated
    assert node.reason == "gpusched: XID 79 on GPU 0; reason=x"
    assert node.gres == "gpu:1g.10gb:1,gpu:4g.40gb:1"
    idle = parse_node("n2", DRAINED.replace("State=MIXED+DRAIN", "State=IDLE").replace(
        "AllocTRES=cpu=1,gres/gpu=1", "AllocTRES=").split(" Reason=")[0])
    assert not idle.drain and not idle.gpus_allocated and idle.reason == ""
    with pytest.raises(SlurmError, match="no node 'n9'"):
        parse_node("n9", "Node n9 not found\n")


def test_a_gpu_counts_as_allocated_from_gres_used_even_when_alloc_tres_does_not_track_it() -> None:
    # Without AccountingStorageTRES=gres/gpu, AllocTRES shows CPUs only; `-d` adds GresUsed.
    base = DRAINED.replace("AllocTRES=cpu=1,gres/gpu=1", "AllocTRES=cpu=1").split(" Reason=")[0]
    used = parse_node("n2", base.replace(" CapWatts", " GresUsed=gpu:1g.10gb:0(IDX:N/A),gpu:4g.40gb:1(IDX:1),mps:0"
                                                     " CapWatts"))
    assert used.gpus_allocated
    free = parse_node("n2", base.replace(" CapWatts", " GresUsed=gpu:1g.10gb:0(IDX:N/A),gpu:4g.40gb:0(IDX:N/A)"
                                                     " CapWatts"))
    assert not free.gpus_allocated
    two = parse_node("n2", base.replace(" CapWatts", " GresUsed=gpu:1g.10gb:2(IDX:0,2) CapWatts"))
    assert two.gpus_allocated and two.gres_used == "gpu:1g.10gb:2(IDX:0,2)"


def test_layout_parsing_names_the_bad_part() -> None:
    assert parse_layout("1=3g.40gb, 2g.20gb;0=none;") == {1: ["3g.40gb", "2g.20gb"], 0: []}
    for bad, needle in (("", "empty"), ("x=1g.10gb", "GPU=PROFILES"), ("0", "GPU=PROFILES"), ("0=", "0=none")):
        with pytest.raises(ValueError, match=needle):
            parse_layout(bad)


def test_gres_comparison_ignores_slurms_decorations_and_empty_shares() -> None:
    assert _same_gres("gpu:1g.10gb:2(S:0),gpu:a100:1,mps:1g.10gb:0", "gpu:a100:1,gpu:1g.10gb:2")
    assert not _same_gres("gpu:1g.10gb:1", "gpu:1g.10gb:2")
