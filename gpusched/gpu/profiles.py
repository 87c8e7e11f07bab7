"""MIG profile tables and GPU model facts, as plain data.

Both the simulator (to behave like the driver) and the planner (to know what fits where) read these
tables, so they live in one pure module with no NVML import. Sources: the NVIDIA MIG user guide
tables, NVIDIA/mig-parted's config-default.yaml, and published `nvidia-smi mig -lgip/-lgipp`
transcripts, cited next to each table; docs/hardware-notes.md lists them per GPU model.

Two ID spaces: `enum` is the pynvml `NVML_GPU_INSTANCE_PROFILE_*` value that
`nvmlDeviceGetGpuInstanceProfileInfo` takes; `profile_id` is the `-lgip` id (19, 14, 9 ...) that the
info struct returns in `.id` and that every create/placement call expects.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MEMORY_SLICES = 8  # every MIG GPU we support has 8 memory slices and 7 compute slices
COMPUTE_SLICES = 7

# pynvml enum values, duplicated here (not imported) because only nvml.py and simnvml.py may import pynvml.
_GI_1 = 0x0  # NVML_GPU_INSTANCE_PROFILE_1_SLICE
_GI_2 = 0x1  # NVML_GPU_INSTANCE_PROFILE_2_SLICE
_GI_3 = 0x2  # NVML_GPU_INSTANCE_PROFILE_3_SLICE
_GI_4 = 0x3  # NVML_GPU_INSTANCE_PROFILE_4_SLICE
_GI_7 = 0x4  # NVML_GPU_INSTANCE_PROFILE_7_SLICE
_GI_1_REV1 = 0x7  # NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1 (+me)
_GI_1_REV2 = 0x9  # NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2 (1 compute slice, double memory)

# Compute-instance profile enums by compute-slice count (NVML_COMPUTE_INSTANCE_PROFILE_*); CI ids are
# the enum values themselves (`nvidia-smi mig -lcip` prints them as the CI profile ID).
CI_ENUM_BY_SLICES: dict[int, int] = {1: 0x0, 2: 0x1, 3: 0x2, 4: 0x3, 7: 0x4, 8: 0x5, 6: 0x6}


@dataclass(frozen=True, slots=True)
class MigProfile:
    """One GPU-instance profile on one GPU model."""

    name: str  # "3g.40gb"
    enum: int  # pynvml NVML_GPU_INSTANCE_PROFILE_* (what GetGpuInstanceProfileInfo takes)
    profile_id: int  # the `-lgip` id, = info.id (what create/placement calls take)
    slices: int  # compute slices (the "Ng")
    memory_slices: int  # placement size, in memory slices
    starts: tuple[int, ...]  # valid placement starts
    max_instances: int  # instanceCount
    sm_count: int
    memory_mib: int  # memorySizeMB as -lgip shows it
    copy_engines: int
    decoders: int
    jpegs: int
    ofas: int

    @property
    def ci_enum(self) -> int:
        """The compute-instance profile enum of the full-size CI for this GI."""
        return CI_ENUM_BY_SLICES[self.slices]

    @property
    def placements(self) -> tuple[tuple[int, int], ...]:
        """All (start, size) placements the driver accepts for this profile."""
        return tuple((s, self.memory_slices) for s in self.starts)


@dataclass(frozen=True, slots=True)
class GpuModel:
    """Facts about one GPU model, as the driver reports them."""

    key: str  # our model key, as used in `--sim` and config
    driver_name: str  # nvmlDeviceGetName
    memory_mib: int  # nvmlDeviceGetMemoryInfo().total / MiB
    sm_count: int  # SMs of the whole GPU with MIG off (service accounting denominator)
    uuid_prefix: str  # simulator UUIDs start "GPU-<prefix>"; hex so UUIDs stay well formed
    profiles: tuple[MigProfile, ...]
    # Hopper-class: a 1-slice REV2 GI (1g.20gb, 1g.35gb ...) also accepts the compute-instance profile
    # 1_SLICE_REV1 (0x7) as its full-size CI (NVIDIA/go-nvlib commit e85aa94: "GPU_INSTANCE_PROFILE_1_SLICE_REV2
    # (when available for systems like the H100) can be deployed with both COMPUTE_INSTANCE_PROFILE_1_SLICE
    # and COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1"; reverted in 7673dc8 without a stated reason). Not
    # claimed for A100, where no source says so (stricter: the simulator refuses it there).
    hopper: bool = False


def _p(
    name: str, enum: int, pid: int, slices: int, mem_slices: int, starts: tuple[int, ...],
    max_inst: int, sms: int, mem_mib: int, engines: tuple[int, int, int, int],
) -> MigProfile:
    ce, dec, jpg, ofa = engines
    return MigProfile(name, enum, pid, slices, mem_slices, starts, max_inst, sms, mem_mib, ce, dec, jpg, ofa)


_ALL_1G = (0, 1, 2, 3, 4, 5, 6)
_EVEN = (0, 2, 4, 6)

# GiB as -lgip prints them, times 1024: 4.75 -> 4864, 9.75 -> 9984, 19.62 -> 20096, 39.50 -> 40448,
# 79.25 -> 81152. (memorySizeMB varies a little with driver version; reference §1.2.)
_A100_40 = (
    _p("1g.5gb", _GI_1, 19, 1, 1, _ALL_1G, 7, 14, 4864, (1, 0, 0, 0)),
    _p("1g.5gb+me", _GI_1_REV1, 20, 1, 1, _ALL_1G, 1, 14, 4864, (1, 1, 1, 1)),
    _p("1g.10gb", _GI_1_REV2, 15, 1, 2, _EVEN, 4, 14, 9984, (1, 1, 0, 0)),
    _p("2g.10gb", _GI_2, 14, 2, 2, (0, 2, 4), 3, 28, 9984, (2, 1, 0, 0)),
    _p("3g.20gb", _GI_3, 9, 3, 4, (0, 4), 2, 42, 20096, (3, 2, 0, 0)),
    _p("4g.20gb", _GI_4, 5, 4, 4, (0,), 1, 56, 20096, (4, 2, 0, 0)),
    _p("7g.40gb", _GI_7, 0, 7, 8, (0,), 1, 98, 40448, (7, 5, 1, 1)),
)
# A100-80GB: same GA100 SM counts and engines (names from the MIG guide). Memory differs by driver
# (NVIDIA/mig-parted issue #31: 535/545 drivers list 1g at 9.50 GiB and name the 3g "3g.39gb"), so
# we take the smaller, stricter values: 1g 9.50 GiB = 9728 MiB (issue #31); 1g.20gb and 2g
# 19.50 GiB = 19968 MiB (the 2g MIG devices of A100-SXM4-80GBs in NVIDIA/DCGM issue #152 and
# XuehaiPan/nvitop PR #8 show 19968MiB); 3g/4g and 7g not published for those drivers: twice the
# next smaller value (the strict rule below), 39936 and 79872 MiB.
_A100_80 = (
    _p("1g.10gb", _GI_1, 19, 1, 1, _ALL_1G, 7, 14, 9728, (1, 0, 0, 0)),
    _p("1g.10gb+me", _GI_1_REV1, 20, 1, 1, _ALL_1G, 1, 14, 9728, (1, 1, 1, 1)),
    _p("1g.20gb", _GI_1_REV2, 15, 1, 2, _EVEN, 4, 14, 19968, (1, 1, 0, 0)),
    _p("2g.20gb", _GI_2, 14, 2, 2, (0, 2, 4), 3, 28, 19968, (2, 1, 0, 0)),
    _p("3g.40gb", _GI_3, 9, 3, 4, (0, 4), 2, 42, 39936, (3, 2, 0, 0)),
    _p("4g.40gb", _GI_4, 5, 4, 4, (0,), 1, 56, 39936, (4, 2, 0, 0)),
    _p("7g.80gb", _GI_7, 0, 7, 8, (0,), 1, 98, 79872, (7, 5, 1, 1)),
)
_H100_80 = (
    _p("1g.10gb", _GI_1, 19, 1, 1, _ALL_1G, 7, 16, 9984, (1, 1, 1, 0)),
    _p("1g.10gb+me", _GI_1_REV1, 20, 1, 1, _ALL_1G, 1, 16, 9984, (1, 1, 1, 1)),
    _p("1g.20gb", _GI_1_REV2, 15, 1, 2, _EVEN, 4, 26, 20096, (1, 1, 1, 0)),
    _p("2g.20gb", _GI_2, 14, 2, 2, (0, 2, 4), 3, 32, 20096, (2, 2, 2, 0)),
    _p("3g.40gb", _GI_3, 9, 3, 4, (0, 4), 2, 60, 40448, (3, 3, 3, 0)),
    _p("4g.40gb", _GI_4, 5, 4, 4, (0,), 1, 64, 40448, (4, 4, 4, 0)),
    _p("7g.80gb", _GI_7, 0, 7, 8, (0,), 1, 132, 81152, (8, 7, 7, 1)),
)
# Hopper profile tables. Every value below cites where it comes from. Where a value is not published
# we pick the one that makes the simulator STRICTER than the hardware (less memory, fewer SMs), never
# looser, and say so: capacity proven in simulation must also exist on the real GPU.
#
# GiB -> memorySizeMB: `nvidia-smi mig -lgip` prints memorySizeMB / 1024 with two decimals, so
# 16.00 -> 16384, 32.25 -> 33024, 69.50 -> 71168, 139.75 -> 143104.
#
# "Unpublished 2n-slice value = twice the published n-slice value" is our strict rule: on every GPU
# with a full transcript it is at or below the real value (H100: 2 x 9.75 = 19.50 <= 19.62,
# 2 x 19.62 <= 39.50, 2 x 39.50 <= 79.25; H200: 2 x 32.25 = 64.50 <= 69.50, 2 x 69.50 <= 139.75).

# H200 141GB: memory, SMs and engines from a real H200 `-lgip` in NVIDIA/mig-parted issue #120
# (1g 16.00 GiB / 16 SM, 1g.35gb and 2g 32.25 GiB / 26 and 32 SM, 3g and 4g 69.50 GiB / 60 and 64 SM,
# 7g 139.75 GiB / 132 SM; CE/DEC/JPEG/OFA as below). IDs and placements: same ids as H100 in that
# transcript; placements not in the transcript, assumed equal to H100 (same instance counts, MIG guide).
_H200 = (
    _p("1g.18gb", _GI_1, 19, 1, 1, _ALL_1G, 7, 16, 16384, (1, 1, 1, 0)),
    _p("1g.18gb+me", _GI_1_REV1, 20, 1, 1, _ALL_1G, 1, 16, 16384, (1, 1, 1, 1)),
    _p("1g.35gb", _GI_1_REV2, 15, 1, 2, _EVEN, 4, 26, 33024, (1, 1, 1, 0)),
    _p("2g.35gb", _GI_2, 14, 2, 2, (0, 2, 4), 3, 32, 33024, (2, 2, 2, 0)),
    _p("3g.71gb", _GI_3, 9, 3, 4, (0, 4), 2, 60, 71168, (3, 3, 3, 0)),
    _p("4g.71gb", _GI_4, 5, 4, 4, (0,), 1, 64, 71168, (4, 4, 4, 0)),
    _p("7g.141gb", _GI_7, 0, 7, 8, (0,), 1, 132, 143104, (8, 7, 7, 1)),
)
# GH200 144G HBM3e: names from mig-parted `deployments/systemd/config-default.yaml` (device 0x2348);
# 1g 17.50 GiB / 16 SM and 1g.36gb, 2g 35.25 GiB / 26, 32 SM from the `-lgip` in NVIDIA/mig-parted
# PR #139. NOT PUBLISHED (in the sources we could read): 3g/4g/7g memory -> strict rule above
# (2 x 35.25 = 70.50 GiB, 2 x 70.50 = 141.00 GiB); their SMs and all engine counts -> as H200 (same
# GH100 die and identical values on every row that is published).
_GH200_144 = (
    _p("1g.18gb", _GI_1, 19, 1, 1, _ALL_1G, 7, 16, 17920, (1, 1, 1, 0)),
    _p("1g.18gb+me", _GI_1_REV1, 20, 1, 1, _ALL_1G, 1, 16, 17920, (1, 1, 1, 1)),
    _p("1g.36gb", _GI_1_REV2, 15, 1, 2, _EVEN, 4, 26, 36096, (1, 1, 1, 0)),
    _p("2g.36gb", _GI_2, 14, 2, 2, (0, 2, 4), 3, 32, 36096, (2, 2, 2, 0)),
    _p("3g.72gb", _GI_3, 9, 3, 4, (0, 4), 2, 60, 72192, (3, 3, 3, 0)),
    _p("4g.72gb", _GI_4, 5, 4, 4, (0,), 1, 64, 72192, (4, 4, 4, 0)),
    _p("7g.144gb", _GI_7, 0, 7, 8, (0,), 1, 132, 144384, (8, 7, 7, 1)),
)
# H100 NVL (94 GB): names from mig-parted config-default.yaml (devices 0x2321/0x233A); 1g 10.75 GiB /
# 16 SM, 1g.24gb and 2g 21.62 GiB / 26, 32 SM from the `-lgip` in NVIDIA/gpu-operator PR #900; 3g.47gb
# 46.38 GiB from NVIDIA/mig-parted PR #101 (maintainer's sum 10.75 + 10.75 + 21.62 + 46.38).
# NOT PUBLISHED: 7g memory -> strict rule (2 x 46.38 = 92.75 GiB); 3g/4g/7g SMs and engines -> as H100.
_H100_NVL = (
    _p("1g.12gb", _GI_1, 19, 1, 1, _ALL_1G, 7, 16, 11008, (1, 1, 1, 0)),
    _p("1g.12gb+me", _GI_1_REV1, 20, 1, 1, _ALL_1G, 1, 16, 11008, (1, 1, 1, 1)),
    _p("1g.24gb", _GI_1_REV2, 15, 1, 2, _EVEN, 4, 26, 22144, (1, 1, 1, 0)),
    _p("2g.24gb", _GI_2, 14, 2, 2, (0, 2, 4), 3, 32, 22144, (2, 2, 2, 0)),
    _p("3g.47gb", _GI_3, 9, 3, 4, (0, 4), 2, 60, 47488, (3, 3, 3, 0)),
    _p("4g.47gb", _GI_4, 5, 4, 4, (0,), 1, 64, 47488, (4, 4, 4, 0)),
    _p("7g.94gb", _GI_7, 0, 7, 8, (0,), 1, 132, 94976, (8, 7, 7, 1)),
)
# GH200 96 GB ("NVIDIA GH200 480GB"): names from mig-parted config-default.yaml (1g.12gb, 2g.24gb,
# 3g.48gb, 4g.48gb, 7g.96gb; devices 0x2342 "GH200"). NO TRANSCRIPT FOUND: memory taken from H100 NVL
# (a 94 GB part, so its slices are no larger than a 96 GB part's: stricter, never looser); SMs and
# engines as H100 (same GH100 die). Corroborated, not proven: a published `nvidia-smi` (driver
# 570.133.20) of an "NVIDIA GH200 480GB" in MIG mode shows MIG devices with 60 SM / 47616 MiB (3g),
# 32 SM / 23552 MiB (2g) and 26 SM / 23552 MiB (1g.24gb); our memorySizeMB values are below those.
_GH200_96 = (
    _p("1g.12gb", _GI_1, 19, 1, 1, _ALL_1G, 7, 16, 11008, (1, 1, 1, 0)),
    _p("1g.12gb+me", _GI_1_REV1, 20, 1, 1, _ALL_1G, 1, 16, 11008, (1, 1, 1, 1)),
    _p("1g.24gb", _GI_1_REV2, 15, 1, 2, _EVEN, 4, 26, 22144, (1, 1, 1, 0)),
    _p("2g.24gb", _GI_2, 14, 2, 2, (0, 2, 4), 3, 32, 22144, (2, 2, 2, 0)),
    _p("3g.48gb", _GI_3, 9, 3, 4, (0, 4), 2, 60, 47488, (3, 3, 3, 0)),
    _p("4g.48gb", _GI_4, 5, 4, 4, (0,), 1, 64, 47488, (4, 4, 4, 0)),
    _p("7g.96gb", _GI_7, 0, 7, 8, (0,), 1, 132, 94976, (8, 7, 7, 1)),
)
# H100 PCIe (80 GB, 114 SMs): mig-parted's config-default.yaml gives it the H100-80GB profiles
# (device 0x2331 is in the "H100-80GB" filter). 114 SMs: NVIDIA's Hopper architecture whitepaper
# (SXM5 132 of GH100's 144 SMs, PCIe 114; as reported in public coverage of it), and llm.c
# `llmc/mfu.h` lists "NVIDIA H100 PCIe" with 456 tensor cores (4 per Hopper SM). NOT PUBLISHED: its
# per-profile SM counts -> H100-80GB's scaled by 114/132 and rounded down (stricter); memory ->
# H100-80GB's (same 81559 MiB total, seen in NVIDIA/DCGM issue #91 `nvidia-smi` output of an "NVIDIA
# H100 PCIe"); engines as H100-80GB.
_H100_PCIE = tuple(
    _p(p.name, p.enum, p.profile_id, p.slices, p.memory_slices, p.starts, p.max_instances,
       p.sm_count * 114 // 132, p.memory_mib, (p.copy_engines, p.decoders, p.jpegs, p.ofas))
    for p in _H100_80
)

MODELS: dict[str, GpuModel] = {
    m.key: m
    for m in (
        # Whole-GPU memory is what nvidia-smi prints as total (each value below is the one in many
        # published `nvidia-smi` outputs of that name); A100 has 108 SMs enabled (98 usable in 7g).
        # A100-SXM4-40GB: 40536 MiB (was 40960 here: 424 MiB more than the hardware has).
        GpuModel("A100-40GB", "NVIDIA A100-SXM4-40GB", 40536, 108, "a1040000", _A100_40),
        GpuModel("A100-80GB", "NVIDIA A100-SXM4-80GB", 81920, 108, "a1080000", _A100_80),
        GpuModel("H100-80GB", "NVIDIA H100 80GB HBM3", 81559, 132, "e1080000", _H100_80, hopper=True),
        GpuModel("H100-PCIe", "NVIDIA H100 PCIe", 81559, 114, "e1080114", _H100_PCIE, hopper=True),
        # 95830 MiB: the total in many published `nvidia-smi` outputs of an "NVIDIA H100 NVL".
        GpuModel("H100-NVL", "NVIDIA H100 NVL", 95830, 132, "e1094000", _H100_NVL, hopper=True),
        # 143771 MiB: published `nvidia-smi` outputs of an "NVIDIA H200".
        GpuModel("H200", "NVIDIA H200", 143771, 132, "e2000141", _H200, hopper=True),
        # 97871 MiB: published `nvidia-smi` outputs of an "NVIDIA GH200 480GB" (the 96 GB HBM3 part).
        GpuModel("GH200-96GB", "NVIDIA GH200 480GB", 97871, 132, "e2000096", _GH200_96, hopper=True),
        # GH200 144G total: NOT PUBLISHED. go-nvlib derives the names from memorySizeMB and the total
        # (getMigMemorySizeGB); "7g.144gb" then needs a total above 143 GiB = 146432 MiB, so we take the
        # smallest total consistent with the published names (stricter than any real one).
        GpuModel("GH200-144GB", "NVIDIA GH200 144G HBM3e", 146433, 132, "e2000144", _GH200_144, hopper=True),
    )
}
MODEL_KEYS: tuple[str, ...] = tuple(MODELS)


def get_model(model: str) -> GpuModel:
    """The model record; KeyError-free ValueError that lists valid keys, for config/CLI messages."""
    try:
        return MODELS[model]
    except KeyError:
        raise ValueError(f"unknown GPU model {model!r}; valid models: {', '.join(MODEL_KEYS)}") from None


def profiles_for(model: str) -> tuple[MigProfile, ...]:
    """All GPU-instance profiles of a model, small to large as the tables list them."""
    return get_model(model).profiles


def profile_by_name(model: str, name: str) -> MigProfile:
    """Look a profile up by its name (`3g.40gb`); ValueError naming the valid ones otherwise."""
    for p in profiles_for(model):
        if p.name == name:
            return p
    valid = ", ".join(p.name for p in profiles_for(model))
    raise ValueError(f"{model} has no MIG profile {name!r}; valid profiles: {valid}")


def profile_by_id(model: str, profile_id: int) -> MigProfile | None:
    """Look a profile up by its `-lgip` id (what GpuInstanceGetInfo reports)."""
    for p in profiles_for(model):
        if p.profile_id == profile_id:
            return p
    return None


def model_from_name(driver_name: str, memory_mib: int | None = None) -> str | None:
    """Map the driver's device name to our model key, or None for a GPU we have no tables for.

    Names vary by form factor ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe", "NVIDIA H100 80GB
    HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200", "NVIDIA GH200 480GB", "NVIDIA GH200
    144G HBM3e"); `memory_mib` settles names that do not carry the memory size. "GH200" is tested
    before "H200" because it contains it. H100 94/96 GB SXM variants are not matched: no profile table
    of theirs was checked against a transcript.
    """
    n = driver_name.upper().replace("-", " ")
    if " MIG " in f" {n} ":  # a MIG device name, e.g. "NVIDIA H100 80GB HBM3 MIG 3g.40gb"
        n = n.split(" MIG ")[0]
    if "GH200" in n:
        if "144G" in n or (memory_mib is not None and memory_mib > 120_000):
            return "GH200-144GB"
        return "GH200-96GB"
    if "H200" in n:
        return "H200"  # H200 NVL shares the H200 profile names (mig-parted config-default.yaml, 0x233B)
    if "H100" in n:
        if "NVL" in n:
            return "H100-NVL"
        if "94GB" in n or "96GB" in n:
            return None
        if "PCIE" in n:
            return "H100-PCIe"
        if "80GB" in n or "SXM" in n or (memory_mib is not None and 70_000 < memory_mib < 90_000):
            return "H100-80GB"
        return None
    if "A100" in n:
        if "80GB" in n:
            return "A100-80GB"
        if "40GB" in n:
            return "A100-40GB"
        if memory_mib is not None:
            return "A100-80GB" if memory_mib > 60_000 else "A100-40GB"
    return None


def place_layout(model: str, profile_names: Sequence[str]) -> list[tuple[str, int]]:
    """A valid (profile, start) for every profile of a layout on an empty GPU.

    Tries large profiles first and backtracks over starts, so layouts whose feasibility depends on
    placement (e.g. 3g + 2g + 2g only fits with the 3g at start 4) are found when they exist. The
    result keeps the order of `profile_names`. ValueError names the first profile that cannot fit.
    """
    profs = [profile_by_name(model, name) for name in profile_names]
    order = sorted(range(len(profs)), key=lambda i: (-profs[i].memory_slices, -profs[i].slices, i))
    starts: dict[int, int] = {}
    deepest = 0  # how far the search got, to name the profile that does not fit

    def search(k: int, used: set[int], counts: dict[int, int]) -> bool:
        nonlocal deepest
        deepest = max(deepest, k)
        if k == len(order):
            return True
        p = profs[order[k]]
        if counts.get(p.profile_id, 0) >= p.max_instances:
            return False
        for start in p.starts:
            cells = set(range(start, start + p.memory_slices))
            if cells & used:
                continue
            starts[order[k]] = start
            counts[p.profile_id] = counts.get(p.profile_id, 0) + 1
            if search(k + 1, used | cells, counts):
                return True
            counts[p.profile_id] -= 1
            del starts[order[k]]
        return False

    if not search(0, set(), {}):
        bad = profs[order[min(deepest, len(order) - 1)]]
        raise ValueError(f"MIG layout does not fit on {model}: no room for {bad.name} in {list(profile_names)}")
    return [(profs[i].name, starts[i]) for i in range(len(profs))]
