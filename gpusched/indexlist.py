"""The kernel's and Slurm's list format, `0-2,5` -> [0, 1, 2, 5]: a NUMA node's cpulist in sysfs,
Slurm's SLURM_JOB_GPUS. One strict parser, because both reach us from outside."""

from __future__ import annotations


def parse_index_list(text: str, what: str, limit: int) -> list[int]:
    """Indices in the order written (blank parts skipped); ValueError naming `what` and the bad part.

    At most `limit` indices in all, so a range such as `0-99999999` cannot make us build a list of
    a hundred million numbers."""
    out: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        lo, dash, hi = part.partition("-")
        if not lo.isdecimal() or (dash and not hi.isdecimal()):
            raise ValueError(f"{what}: {part!r} is not an index or a range")
        if dash and (int(hi) < int(lo) or int(hi) - int(lo) >= limit):
            # (an empty range would leave a Slurm job no CUDA_VISIBLE_DEVICES: every GPU of the node)
            raise ValueError(f"{what}: {part!r} is not a range of at most {limit} indices")
        out.extend(range(int(lo), int(hi) + 1) if dash else [int(lo)])
        if len(out) > limit:
            raise ValueError(f"{what}: more than {limit} indices")
    return out
