"""Contract per GPU model: the simulator's answers against published `nvidia-smi mig -lgip` transcripts.

Expected data is copied from the transcripts (sources next to each table) and is never computed from
gpusched's own tables. Where no transcript exists, the test checks that our value is on the strict
side of what is known (less memory, fewer SMs), so capacity proven in simulation exists on hardware.
"""

from __future__ import annotations

from typing import Any

import pynvml
import pytest

from gpusched.gpu.profiles import MODEL_KEYS, MODELS
from gpusched.gpu.simnvml import SimNVML

# (name, -lgip ID, instances total, memory GiB as printed, SM, DEC, ENC, CE, JPEG, OFA); None = not
# visible in the published excerpt.
Row = tuple[str, int, int, str, int, int | None, int | None, int | None, int | None, int | None]

TRANSCRIPTS: dict[str, list[Row]] = {
    # A100-SXM4-40GB `-lgip` (NVIDIA MIG user guide, getting-started example).
    "A100-40GB": [
        ("1g.5gb", 19, 7, "4.75", 14, 0, 0, 1, 0, 0),
        ("1g.5gb+me", 20, 1, "4.75", 14, 1, 0, 1, 1, 1),
        ("2g.10gb", 14, 3, "9.75", 28, 1, 0, 2, 0, 0),
        ("3g.20gb", 9, 2, "19.62", 42, 2, 0, 3, 0, 0),
        ("4g.20gb", 5, 1, "19.62", 56, 2, 0, 4, 0, 0),
        ("7g.40gb", 0, 1, "39.50", 98, 5, 0, 7, 1, 1),
    ],
    # H100 80GB HBM3 `-lgip` (published transcript, wiki.hpcmate.com "MIG").
    "H100-80GB": [
        ("1g.10gb", 19, 7, "9.75", 16, 1, 0, 1, 1, 0),
        ("1g.10gb+me", 20, 1, "9.75", 16, 1, 0, 1, 1, 1),
        ("1g.20gb", 15, 4, "19.62", 26, 1, 0, 1, 1, 0),
        ("2g.20gb", 14, 3, "19.62", 32, 2, 0, 2, 2, 0),
        ("3g.40gb", 9, 2, "39.50", 60, 3, 0, 3, 3, 0),
        ("4g.40gb", 5, 1, "39.50", 64, 4, 0, 4, 4, 0),
        ("7g.80gb", 0, 1, "79.25", 132, 7, 0, 8, 7, 1),
    ],
    # NVIDIA H200 `-lgip`, NVIDIA/mig-parted issue #120.
    "H200": [
        ("1g.18gb", 19, 7, "16.00", 16, 1, 0, 1, 1, 0),
        ("1g.18gb+me", 20, 1, "16.00", 16, 1, 0, 1, 1, 1),
        ("1g.35gb", 15, 4, "32.25", 26, 1, 0, 1, 1, 0),
        ("2g.35gb", 14, 3, "32.25", 32, 2, 0, 2, 2, 0),
        ("3g.71gb", 9, 2, "69.50", 60, 3, 0, 3, 3, 0),
        ("4g.71gb", 5, 1, "69.50", 64, 4, 0, 4, 4, 0),
        ("7g.141gb", 0, 1, "139.75", 132, 7, 0, 8, 7, 1),
    ],
    # GH200 144G HBM3e `-lgip`, NVIDIA/mig-parted PR #139 (rows visible in the published excerpt).
    "GH200-144GB": [
        ("1g.18gb", 19, 7, "17.50", 16, 1, 0, 1, 1, 0),
        ("1g.18gb+me", 20, 1, "17.50", 16, 1, 0, 1, 1, 1),
        ("1g.36gb", 15, 4, "35.25", 26, 1, 0, 1, 1, 0),
        ("2g.36gb", 14, 3, "35.25", 32, 2, 0, 2, 2, 0),
    ],
    # H100 NVL `-lgip`, NVIDIA/gpu-operator PR #900; 3g.47gb memory from NVIDIA/mig-parted PR #101.
    "H100-NVL": [
        ("1g.12gb", 19, 7, "10.75", 16, 1, 0, 1, 1, 0),
        ("1g.12gb+me", 20, 1, "10.75", 16, 1, 0, 1, 1, 1),
        ("1g.24gb", 15, 4, "21.62", 26, 1, 0, 1, 1, 0),
        ("2g.24gb", 14, 3, "21.62", 32, None, None, None, None, None),
        ("3g.47gb", 9, 2, "46.38", 60, None, None, None, None, None),
    ],
    "H100-PCIe": [],  # no transcript found: checked by test_unpublished_values_are_strict
    "A100-80GB": [],  # names only (MIG guide); memorySizeMB varies by driver (mig-parted issue #31)
    "GH200-96GB": [],  # no `-lgip` found: checked by test_unpublished_values_are_strict
}

# Profile names per model: NVIDIA/mig-parted deployments/systemd/config-default.yaml (and the MIG guide
# for A100/H100/H200).
NAMES: dict[str, set[str]] = {
    "A100-40GB": {"1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"},
    "A100-80GB": {"1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"},
    "H100-80GB": {"1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"},
    "H100-PCIe": {"1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"},
    "H100-NVL": {"1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb"},
    "H200": {"1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"},
    "GH200-96GB": {"1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb"},
    "GH200-144GB": {"1g.18gb", "1g.18gb+me", "1g.36gb", "2g.36gb", "3g.72gb", "4g.72gb", "7g.144gb"},
}

# Whole-GPU facts: (nvmlDeviceGetName, total MiB as nvidia-smi prints it or None when unpublished).
DEVICES: dict[str, tuple[str, int | None]] = {
    "A100-40GB": ("NVIDIA A100-SXM4-40GB", 40536),  # published nvidia-smi outputs
    "A100-80GB": ("NVIDIA A100-SXM4-80GB", 81920),  # published nvidia-smi outputs
    "H100-80GB": ("NVIDIA H100 80GB HBM3", 81559),  # published nvidia-smi outputs
    "H100-PCIe": ("NVIDIA H100 PCIe", 81559),  # NVIDIA/DCGM issue #91
    "H100-NVL": ("NVIDIA H100 NVL", 95830),  # published nvidia-smi outputs
    "H200": ("NVIDIA H200", 143771),  # published nvidia-smi outputs
    "GH200-96GB": ("NVIDIA GH200 480GB", 97871),  # published nvidia-smi outputs
    "GH200-144GB": ("NVIDIA GH200 144G HBM3e", None),
}


def _infos(model: str) -> dict[str, Any]:
    s = SimNVML([model])
    s.nvmlInit()
    h = s.nvmlDeviceGetHandleByIndex(0)
    assert s.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_ENABLE) == pynvml.NVML_SUCCESS
    out = {}
    for enum in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = s.nvmlDeviceGetGpuInstanceProfileInfo(h, enum)
        except pynvml.NVMLError_NotSupported:
            continue
        raw = info.name
        out[(raw.decode() if isinstance(raw, bytes) else str(raw)).removeprefix("MIG ")] = info
    return out


def test_every_model_has_contract_data() -> None:
    assert set(TRANSCRIPTS) == set(MODEL_KEYS) == set(NAMES) == set(DEVICES)


@pytest.mark.parametrize("model", MODEL_KEYS)
def test_profile_names_match_mig_parted(model: str) -> None:
    assert set(_infos(model)) == NAMES[model]


@pytest.mark.parametrize("model", MODEL_KEYS)
def test_lgip_rows_match_transcript(model: str) -> None:
    infos = _infos(model)
    for name, pid, count, gib, sm, dec, enc, ce, jpeg, ofa in TRANSCRIPTS[model]:
        info = infos[name]
        assert (info.id, info.instanceCount, f"{info.memorySizeMB / 1024:.2f}", info.multiprocessorCount) == (
            pid, count, gib, sm), name
        for field, want in (("decoderCount", dec), ("encoderCount", enc), ("copyEngineCount", ce),
                            ("jpegCount", jpeg), ("ofaCount", ofa)):
            if want is not None:
                assert getattr(info, field) == want, (name, field)


@pytest.mark.parametrize("model", MODEL_KEYS)
def test_device_name_and_total(model: str) -> None:
    s = SimNVML([model])
    s.nvmlInit()
    h = s.nvmlDeviceGetHandleByIndex(0)
    name, total = DEVICES[model]
    assert s.nvmlDeviceGetName(h) == name
    if total is not None:
        assert s.nvmlDeviceGetMemoryInfo(h).total == total * 1024 * 1024


def test_h200_small_profiles_no_longer_overstate_memory() -> None:
    """The issue's headline: 1g.18gb was 17664 MiB in simulation, 16384 on a real H200."""
    infos = _infos("H200")
    assert infos["1g.18gb"].memorySizeMB == 16384
    assert infos["1g.35gb"].memorySizeMB == infos["2g.35gb"].memorySizeMB == 33024
    assert infos["3g.71gb"].memorySizeMB == infos["4g.71gb"].memorySizeMB == 71168
    assert infos["7g.141gb"].memorySizeMB == 143104


def test_unpublished_values_are_strict() -> None:
    """No transcript: our values must not exceed what is known about the hardware."""
    pcie, sxm = _infos("H100-PCIe"), _infos("H100-80GB")
    assert MODELS["H100-PCIe"].sm_count == 114  # llm.c llmc/mfu.h: 456 tensor cores = 114 SMs x 4
    for name, info in pcie.items():
        assert info.multiprocessorCount <= sxm[name].multiprocessorCount
        assert info.multiprocessorCount * 132 <= sxm[name].multiprocessorCount * 114
    assert pcie["7g.80gb"].multiprocessorCount == 114
    # GH200 480GB in MIG mode, published `nvidia-smi` (driver 570.133.20): MIG devices of 60 SM /
    # 47616 MiB, 32 SM / 23552 MiB and 26 SM / 23552 MiB.
    gh = _infos("GH200-96GB")
    for name, sm, mib in (("3g.48gb", 60, 47616), ("2g.24gb", 32, 23552), ("1g.24gb", 26, 23552)):
        assert gh[name].multiprocessorCount == sm
        assert gh[name].memorySizeMB <= mib
    # Unpublished larger profiles never exceed twice the published half-size profile.
    for model, small, big in (("GH200-144GB", "2g.36gb", "3g.72gb"), ("GH200-144GB", "3g.72gb", "7g.144gb"),
                              ("H100-NVL", "3g.47gb", "7g.94gb")):
        infos = _infos(model)
        assert infos[big].memorySizeMB <= 2 * infos[small].memorySizeMB
