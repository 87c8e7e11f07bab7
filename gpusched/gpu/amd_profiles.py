"""AMD Instinct model facts for the amdsmi backend and its simulator, each figure with its source.

Kept apart from profiles.py (the NVIDIA MIG tables) because AMD partitions differently: a physical
GPU is split by a *compute* mode (how many logical GPUs its XCDs form) and a *memory* mode (how many
NUMA partitions its HBM forms), and each logical GPU is enumerated by amdsmi as a device of its own.

Sources (see docs/gpu.md, "AMD Instinct (amdsmi)"):
  [XCD]  AMD, "AMD Instinct MI300X GPU Partitioning Overview":
         https://instinct.docs.amd.com/projects/amdgpu-docs/en/latest/gpu-partitioning/mi300x/overview.html
         ("each XCD contains 38 Compute Units"); amdsmi "GPU partitioning":
         https://rocm.docs.amd.com/projects/amdsmi/en/latest/conceptual/partition.html ("MI300X has 8 XCDs")
  [QSG]  AMD, "Quick Start Guide to Partitioning MI300X GPUs":
         https://instinct.docs.amd.com/projects/amdgpu-docs/en/latest/gpu-partitioning/mi300x/quick-start-guide.html
         (CPX: eight logical GPUs; NPS4: "four memory partitions of 48GB each")
  [KRN]  Linux amdgpu, drivers/gpu/drm/amd/amdgpu/aqua_vanjaram.c, __aqua_vanjaram_get_px_mode_info
         (compatible NPS modes per compute mode: SPX {NPS1}; DPX {NPS1, NPS2}; QPX {NPS1, NPS4};
         CPX {NPS1, NPS4}) and amdgpu_amdkfd.c, amdgpu_amdkfd_xcp_memory_size (a logical GPU's memory
         is its memory partition's size divided by the logical GPUs sharing that partition)
  [PCI]  pci.ids: 1002:74a1 "Aqua Vanjaram [Instinct MI300X]", 1002:74a5 "Aqua Vanjaram [Instinct MI325X]"
  [MI300X] AMD product page, https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html:
         304 CUs, 192 GB HBM3 (8 stacks)
  [MI325X] AMD product page, https://www.amd.com/en/products/accelerators/instinct/mi300/mi325x.html:
         304 CUs, 256 GB HBM3E (read through secondary pages quoting it; the page itself was not read)
"""

from __future__ import annotations

from dataclasses import dataclass

# Logical GPUs per physical GPU in each compute mode, for an 8-XCD part [XCD], [QSG].
PARTITIONS_PER_MODE: dict[str, int] = {"SPX": 1, "DPX": 2, "QPX": 4, "CPX": 8}
# NUMA memory partitions per memory mode.
MEMORY_PARTITIONS_PER_MODE: dict[str, int] = {"NPS1": 1, "NPS2": 2, "NPS4": 4, "NPS8": 8}


@dataclass(frozen=True, slots=True)
class AmdModel:
    """One AMD Instinct model: its silicon and the partition modes the driver accepts on it."""

    key: str  # our model key, e.g. "MI300X"
    market_name: str  # what amdsmi_get_gpu_asic_info reports as market_name (assumed: the product name)
    device_id: int  # PCI device id [PCI]
    xcds: int
    cus_per_xcd: int
    memory_mib: int  # nominal HBM; what the driver reports after firmware reservations is unpublished
    memory_modes: tuple[str, ...]  # the NPS modes the part offers
    combinations: dict[str, tuple[str, ...]]  # compute mode -> memory modes it may run with [KRN]
    boot_compute: str = "SPX"
    boot_memory: str = "NPS1"

    @property
    def compute_units(self) -> int:
        return self.xcds * self.cus_per_xcd

    @property
    def compute_modes(self) -> tuple[str, ...]:
        return tuple(self.combinations)

    def is_valid(self, compute: str, memory: str) -> bool:
        return memory in self.combinations.get(compute, ())

    def valid_combinations(self) -> list[tuple[str, str]]:
        return [(c, m) for c, ms in self.combinations.items() for m in ms]

    def partitions(self, compute: str) -> int:
        """Logical GPUs in a compute mode: one per XCD group [KRN: num_xcp]."""
        return PARTITIONS_PER_MODE[compute]

    def cus_per_partition(self, compute: str) -> int:
        return self.compute_units // self.partitions(compute)

    def memory_per_partition_mib(self, compute: str, memory: str) -> int:
        """[KRN] amdgpu_amdkfd_xcp_memory_size: memory partition size / logical GPUs sharing it,
        which comes to total / logical GPUs whenever the partition count divides evenly."""
        per_mem_partition = self.memory_mib // MEMORY_PARTITIONS_PER_MODE[memory]
        sharing = self.partitions(compute) // MEMORY_PARTITIONS_PER_MODE[memory]
        return per_mem_partition // max(1, sharing)


# The compute/memory combinations the kernel accepts for 8-XCD CDNA3 parts [KRN], restricted to the
# NPS modes the part offers. MI300X offers NPS1 and NPS4 [QSG], so DPX runs with NPS1 only.
_CDNA3_COMBINATIONS: dict[str, tuple[str, ...]] = {
    "SPX": ("NPS1",),
    "DPX": ("NPS1",),
    "QPX": ("NPS1", "NPS4"),
    "CPX": ("NPS1", "NPS4"),
}

AMD_MODELS: dict[str, AmdModel] = {
    "MI300X": AmdModel(
        key="MI300X",
        market_name="AMD Instinct MI300X",
        device_id=0x74A1,  # [PCI]
        xcds=8,  # [XCD]
        cus_per_xcd=38,  # [XCD]; 8 x 38 = 304 CUs [MI300X]
        memory_mib=192 * 1024,  # 192 GB HBM3 [MI300X]; NPS4 = 4 x 48 GB [QSG]
        memory_modes=("NPS1", "NPS4"),  # [QSG]
        combinations=_CDNA3_COMBINATIONS,
    ),
    # Same CDNA3 compute silicon as MI300X (304 CUs, 8 XCDs) with 256 GB HBM3E [MI325X]. Which NPS
    # modes AMD enables on it is not published for bare metal; we assume MI300X's (NPS1, NPS4).
    "MI325X": AmdModel(
        key="MI325X",
        market_name="AMD Instinct MI325X",
        device_id=0x74A5,  # [PCI]
        xcds=8,  # [MI325X]
        cus_per_xcd=38,  # 304 CUs [MI325X]
        memory_mib=256 * 1024,  # 256 GB HBM3E [MI325X]
        memory_modes=("NPS1", "NPS4"),  # assumed (unpublished), see above
        combinations=_CDNA3_COMBINATIONS,
    ),
}
AMD_MODEL_KEYS: tuple[str, ...] = tuple(AMD_MODELS)


def amd_model(key: str) -> AmdModel:
    """The model for a key, or ValueError naming the known ones (for `--sim` specs)."""
    try:
        return AMD_MODELS[key]
    except KeyError:
        raise ValueError(f"unknown AMD model {key!r}; known: {', '.join(AMD_MODEL_KEYS)}") from None


def model_of_market_name(name: str) -> AmdModel | None:
    """Match amdsmi's market_name (e.g. "AMD Instinct MI300X", "MI300X") to a model, longest key first."""
    upper = name.upper()
    for key in sorted(AMD_MODELS, key=len, reverse=True):
        if key in upper:
            return AMD_MODELS[key]
    return None
