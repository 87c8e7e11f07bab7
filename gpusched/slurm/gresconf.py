"""gres.conf, the slurm.conf NodeName fragment and the GRES index -> UUID map, from the live inventory.

Debian's Slurm is built without NVML (`AutoDetect=nvml` is unavailable), so each node needs a
gres.conf that names every device by hand, and it must match the MIG layout of the moment. Pure:
this module turns a `GpusResult` into text; writing files and device nodes is elsewhere.

Order matters. Slurm numbers a node's GPUs (the indices in SLURM_JOB_GPUS and `IDX:` of
`scontrol show job -d`) in the order of its gres.conf records grouped by type, in the order the
types appear in the node's `Gres=`. We therefore group records by type (whole GPUs first, then MIG
profiles by name; within a type by GPU index then memory slice), write `Gres=` in the same order,
and number the map alike.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass

from gpusched.protocol import GpuInfo, GpusResult

MIG_MINORS_PER_GPU = 15 * 9  # /proc/driver/nvidia-caps/mig-minors: 15 GIs x (1 GI + 8 CIs) per GPU
_FIRST_GI_MINOR = 3  # minors 1 and 2 are "config" and "monitor"
MPS_COUNT_PER_GPU = 100  # gres/mps counts percent of a GPU


@dataclass(frozen=True)
class GresDevice:
    """One Slurm GRES record: a whole GPU or a MIG instance, and its device files."""

    index: int  # Slurm's GRES index on the node (SLURM_JOB_GPUS)
    type: str  # Slurm GRES type: a MIG profile ("1g.10gb") or the GPU model ("a100-40gb")
    uuid: str  # GPU-... or MIG-...
    gpu_index: int
    gpu_uuid: str
    gi_id: int | None  # None for a whole GPU
    files: tuple[str, ...]
    mps: bool  # a whole GPU configured share = "mps": jobs on it get a per-user MPS control daemon
    gres_mps: bool = False  # also offered to Slurm as gres/mps (export --gres-mps)
    shards: int = 0  # also offered to Slurm as this many gres/shard (export --gres-shard N)


def gpu_type(model: str) -> str:
    """Slurm GRES type of a whole GPU: our model key in lower case (`A100-40GB` -> `a100-40gb`)."""
    return re.sub(r"[^a-z0-9.-]", "-", model.lower())


def mig_cap_minors(gpu_index: int, gi_id: int, ci_id: int = 0) -> tuple[int, int]:
    """The nvidia-caps minors of a MIG GPU instance's and compute instance's `access` files, as the
    driver numbers them in /proc/driver/nvidia-caps/mig-minors (gpu0/gi2/access = 21, .../ci0 = 22).
    gpusched gives every GPU instance one full-size compute instance, whose id is 0."""
    gi_minor = _FIRST_GI_MINOR + gpu_index * MIG_MINORS_PER_GPU + gi_id * 9
    return gi_minor, gi_minor + 1 + ci_id


def device_files(gpu: GpuInfo, gi_id: int | None, dev_root: str) -> tuple[str, ...]:
    parent = f"{dev_root}/nvidia{gpu.index}"
    if gi_id is None:
        return (parent,)
    gi_minor, ci_minor = mig_cap_minors(gpu.index, gi_id)
    return (parent, f"{dev_root}/nvidia-caps/nvidia-cap{gi_minor}", f"{dev_root}/nvidia-caps/nvidia-cap{ci_minor}")


def devices(result: GpusResult, dev_root: str = "/dev", gres_mps: bool = False,
            gres_shards: int = 0) -> list[GresDevice]:
    """Every schedulable device of the node, numbered as Slurm will number it.

    A GPU in MIG mode offers only its instances (an empty MIG GPU offers nothing); a GPU out of MIG
    mode is one device. A GPU whose instances have no GI id (an old daemon) cannot be described.
    """
    found: list[tuple[str, int, int, GpuInfo, str, int | None]] = []
    amd = [str(g.index) for g in result.gpus if g.vendor == "amd"]
    if amd:  # the hooks would give such a job CUDA_VISIBLE_DEVICES with AMD ids and NVIDIA device files
        raise ValueError(f"GPU(s) {', '.join(amd)} are AMD Instinct logical GPUs: the Slurm export writes NVIDIA "
                         "device files and CUDA_VISIBLE_DEVICES and does not support AMD nodes yet (Slurm's own "
                         "gres.conf AutoDetect=rsmi can describe them)")
    for gpu in result.gpus:
        if gpu.mig_enabled:
            for inst in gpu.instances:
                if inst.gi_id is None:
                    raise ValueError(f"GPU {gpu.index}: instance {inst.uuid} has no GPU instance id; "
                                     "upgrade gpuschedd")
                found.append((inst.profile, gpu.index, inst.start, gpu, inst.uuid, inst.gi_id))
        else:
            found.append((gpu_type(gpu.model), gpu.index, 0, gpu, gpu.uuid, None))
    first: dict[str, int] = {}
    for type_, index, _, _, _, gi_id in sorted(found, key=lambda f: f[1]):
        if gi_id is None:
            first.setdefault(type_, index)
    # Whole GPUs first, their types in GPU order (so that GPU N is record N when GPUs 0..N are whole,
    # which gres/mps needs, see mps_pairs); then MIG types by name; within a type by GPU and slice.
    found.sort(key=lambda f: (0, first[f[0]], "", f[1], f[2]) if f[5] is None else (1, 0, f[0], f[1], f[2]))
    no_mig = not any(g.mig_enabled for g in result.gpus)
    out = []
    for i, (type_, _, _, gpu, uuid, gi_id) in enumerate(found):
        shared = no_mig and gi_id is None and gpu.share == "mps" and i == gpu.index  # see mps_skipped
        out.append(GresDevice(index=i, type=type_, uuid=uuid, gpu_index=gpu.index, gpu_uuid=gpu.uuid, gi_id=gi_id,
                              files=device_files(gpu, gi_id, dev_root), mps=gi_id is None and gpu.share == "mps",
                              gres_mps=gres_mps and shared, shards=gres_shards if shared else 0))
    return out


def mps_skipped(result: GpusResult, devs: list[GresDevice]) -> list[str]:
    """Why GPUs configured share = "mps" are not offered as gres/mps or gres/shard although export
    asked (Slurm 22.05's limits, seen on a real slurmd): with MIG GPUs, Slurm allocates typed GPU
    requests zero devices once mps or shard is in GresTypes; and it pairs such a record with the
    GPU record whose position equals the number in its File= (/dev/nvidiaN), true for GPU N only
    when GPUs 0..N are whole GPUs."""
    offered = {d.gpu_index for d in devs if d.gres_mps or d.shards}
    mig = any(g.mig_enabled for g in result.gpus)
    return [f"GPU {g.index}: " + ("Slurm cannot mix gres/mps with MIG GPUs on one node" if mig else
                                  "gres/mps needs GPUs 0..N to be whole GPUs")
            for g in result.gpus if g.share == "mps" and not g.mig_enabled and g.index not in offered]


def gres_conf(node: str, devs: list[GresDevice]) -> str:
    """gres.conf records for `node`: File= for a whole GPU, MultipleFiles= for a MIG instance, and
    on each GPU shared through MPS a gres/mps record (Count=100, percent; --gres-mps) and/or a
    gres/shard record (--gres-shard N)."""
    lines = [f"# node {node}: {len(devs)} GPU device(s), generated by `gpusched slurm export`"]
    for d in devs:
        key = "MultipleFiles" if d.gi_id is not None else "File"
        lines.append(f"# GRES index {d.index}: {d.uuid}")
        lines.append(f"NodeName={node} Name=gpu Type={d.type} {key}={','.join(d.files)}")
    for d in devs:
        if d.gres_mps:
            lines.append(f"NodeName={node} Name=mps Type={d.type} Count={MPS_COUNT_PER_GPU} File={d.files[0]}")
        if d.shards:
            lines.append(f"NodeName={node} Name=shard Type={d.type} Count={d.shards} File={d.files[0]}")
    return "\n".join(lines) + "\n"


def gres_spec(devs: list[GresDevice]) -> str:
    """The value of `Gres=` for slurm.conf: typed GPU counts in gres.conf's order, then mps."""
    counts: dict[str, int] = {}
    for d in devs:
        counts[d.type] = counts.get(d.type, 0) + 1
    parts = [f"gpu:{t}:{n}" for t, n in counts.items()]
    mps: dict[str, int] = {}
    shards: dict[str, int] = {}
    for d in devs:
        if d.gres_mps:
            mps[d.type] = mps.get(d.type, 0) + MPS_COUNT_PER_GPU
        if d.shards:
            shards[d.type] = shards.get(d.type, 0) + d.shards
    parts += [f"mps:{t}:{n}" for t, n in mps.items()]
    parts += [f"shard:{t}:{n}" for t, n in shards.items()]
    return ",".join(parts)


def node_line(node: str, devs: list[GresDevice], params: str = "") -> str:
    """`NodeName=NODE [PARAMS] Gres=...` for slurm.conf (PARAMS: NodeAddr=, CPUs=, ... kept as given)."""
    gres = gres_spec(devs)
    return " ".join(p for p in (f"NodeName={node}", params.strip(), f"Gres={gres}" if gres else "") if p) + "\n"


def billing_weights(result: GpusResult) -> str:
    """TRESBillingWeights terms that charge each typed GPU as gpusched's service does: the fraction
    of the GPU's SMs it has (a whole GPU 1.0; an A100 1g.10gb 14 of 108 SMs, about 1/7 of the seven
    slices). Only typed terms: a job counts against both gres/gpu and gres/gpu:TYPE, so weighing
    both would charge it twice."""
    weights: dict[str, float] = {}
    for gpu in result.gpus:
        if gpu.mig_enabled:
            for inst in gpu.instances:
                weights.setdefault(inst.profile, inst.sm_count / gpu.sm_count)
        else:
            weights.setdefault(gpu_type(gpu.model), 1.0)
    return ",".join(f"GRES/gpu:{t}={w:.4f}" for t, w in sorted(weights.items()))


def gres_map(node: str, devs: list[GresDevice]) -> str:
    """JSON: Slurm's GRES index -> device (what the job hooks read to turn indices into UUIDs)."""
    return json.dumps({"node": node, "gpus": [asdict(d) for d in devs]}, indent=2) + "\n"


def load_map(text: str) -> list[GresDevice]:
    """The devices of a map written by `gres_map`; ValueError naming what is wrong."""
    try:
        data = json.loads(text)
        out = []
        for i, d in enumerate(data["gpus"]):
            dev = GresDevice(**{**d, "files": tuple(d["files"])})  # unknown keys: TypeError, below
            if dev.index != i:
                raise ValueError(f"entry {i} has index {dev.index}")
            out.append(dev)
        return out
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a gpusched GRES map: {exc}") from None


_BEGIN = "# BEGIN gpusched node {node}"
_END = "# END gpusched node {node}"


def _is_marker(line: str, marker: str) -> bool:
    """`line` is `marker` itself, alone or followed by a space: node n1's marker is a prefix of n10's."""
    line = line.rstrip("\r\n")
    return line == marker or line.startswith(marker + " ")


def replace_block(text: str, node: str, body: str) -> str:
    """`text` with the block gpusched manages for `node` replaced by `body` (appended if absent), so
    relayout can rewrite one node's lines in a shared gres.conf or slurm.conf and leave the rest."""
    begin, end = _BEGIN.format(node=node), _END.format(node=node)
    block = f"{begin} (generated by gpusched; do not edit)\n{body.rstrip(chr(10))}\n{end}\n"
    lines = text.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if _is_marker(ln, begin)), None)
    if start is None:
        return text + ("" if not text or text.endswith("\n") else "\n") + block
    stop = next((i for i in range(start, len(lines)) if _is_marker(lines[i], end)), None)
    if stop is None:
        raise ValueError(f"'{begin}' without '{end}'")
    return "".join(lines[:start]) + block + "".join(lines[stop + 1:])


def block_body(text: str, node: str) -> str | None:
    """The lines inside `node`'s block, or None when there is none."""
    begin, end = _BEGIN.format(node=node), _END.format(node=node)
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if _is_marker(ln, begin)), None)
    if start is None:
        return None
    stop = next((i for i in range(start, len(lines)) if _is_marker(lines[i], end)), len(lines))
    return "\n".join(lines[start + 1:stop])


def node_params(line: str) -> str:
    """The parameters of a `NodeName=` line other than NodeName= and Gres= (kept across a relayout)."""
    return " ".join(t for t in line.split() if not t.startswith(("NodeName=", "Gres=")))
