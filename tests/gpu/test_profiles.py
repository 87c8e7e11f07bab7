"""The profile tables: internal consistency, name mapping and layout placement."""

from __future__ import annotations

import math

import pytest

from gpusched.gpu.profiles import (
    MEMORY_SLICES,
    MODELS,
    model_from_name,
    place_layout,
    profile_by_id,
    profile_by_name,
    profiles_for,
)


def test_tables_are_consistent(model: str) -> None:
    profs = profiles_for(model)
    assert [p.profile_id for p in profs] == [19, 20, 15, 14, 9, 5, 0]
    assert [p.enum for p in profs] == [0x0, 0x7, 0x9, 0x1, 0x2, 0x3, 0x4]
    full = profs[-1]
    assert full.slices == 7 and full.memory_slices == MEMORY_SLICES and full.starts == (0,)
    for p in profs:
        assert all(s >= 0 and s + p.memory_slices <= MEMORY_SLICES for s in p.starts)
        assert p.max_instances <= len(p.starts)
        assert p.sm_count <= MODELS[model].sm_count
        assert p.memory_mib <= MODELS[model].memory_mib
        assert profile_by_name(model, p.name) is p
        assert profile_by_id(model, p.profile_id) is p


def _gonvlib_gb(mem_mib: int, total_mib: int) -> int:
    """go-nvlib's getMigMemorySizeGB: how real tools derive the name from memorySizeMB."""
    frac = math.ceil(mem_mib / total_mib * 8) / 8
    return math.floor(frac * math.ceil(total_mib / 1024) + 0.5)


def test_names_match_memory_like_go_nvlib(model: str) -> None:
    total = MODELS[model].memory_mib
    for p in profiles_for(model):
        gb = int(p.name.split(".")[1].removesuffix("+me").removesuffix("gb"))
        assert _gonvlib_gb(p.memory_mib, total) == gb, p.name


def test_profile_by_name_lists_valid_names() -> None:
    with pytest.raises(ValueError, match=r"3g\.40gb"):
        profile_by_name("H100-80GB", "3g.20gb")
    with pytest.raises(ValueError, match="valid models"):
        profiles_for("V100")


@pytest.mark.parametrize(
    ("name", "memory", "key"),
    [
        ("NVIDIA A100-SXM4-40GB", None, "A100-40GB"),
        ("NVIDIA A100-PCIE-40GB", None, "A100-40GB"),
        ("NVIDIA A100-SXM4-80GB", None, "A100-80GB"),
        ("NVIDIA A100 80GB PCIe", None, "A100-80GB"),
        ("NVIDIA A100-SXM4", 81920, "A100-80GB"),
        ("NVIDIA H100 80GB HBM3", None, "H100-80GB"),
        ("NVIDIA H100 PCIe", None, "H100-PCIe"),
        ("NVIDIA H100 NVL", None, "H100-NVL"),
        ("NVIDIA GH200 480GB", None, "GH200-96GB"),
        ("NVIDIA GH200 120GB", None, "GH200-96GB"),
        ("NVIDIA GH200 144G HBM3e", None, "GH200-144GB"),
        ("NVIDIA GH200", 146433, "GH200-144GB"),
        ("NVIDIA GH200 480GB MIG 3g.48gb", None, "GH200-96GB"),
        ("NVIDIA H200", None, "H200"),
        ("NVIDIA H200 NVL", None, "H200"),
        ("NVIDIA H100 80GB HBM3 MIG 3g.40gb", None, "H100-80GB"),
        ("NVIDIA GeForce RTX 4090", None, None),
        ("Tesla V100-SXM2-16GB", None, None),
    ],
)
def test_model_from_name(name: str, memory: int | None, key: str | None) -> None:
    assert model_from_name(name, memory) == key


def test_model_from_name_knows_every_driver_name(model: str) -> None:
    assert model_from_name(MODELS[model].driver_name) == model


def test_place_layout_backtracks(model: str) -> None:
    names = [p.name for p in profiles_for(model)]
    one, two, three, four, seven = names[0], names[3], names[4], names[5], names[6]
    # 2g + 3g + 2g fits only with the 3g at 4 and the 2gs at 0 and 2; order of the input is kept.
    assert place_layout(model, [two, three, two]) == [(two, 0), (three, 4), (two, 2)]
    layout = place_layout(model, [one] * 7)
    assert sorted(s for _, s in layout) == list(range(7))
    assert place_layout(model, [seven]) == [(seven, 0)]
    assert place_layout(model, [four, three]) == [(four, 0), (three, 4)]
    assert place_layout(model, []) == []


def test_place_layout_names_what_does_not_fit(model: str) -> None:
    names = [p.name for p in profiles_for(model)]
    with pytest.raises(ValueError, match=re_escape(names[0])):
        place_layout(model, [names[5], names[4], names[0]])  # 4g + 3g fill all 8 slices
    with pytest.raises(ValueError, match=re_escape(names[4])):
        place_layout(model, [names[4]] * 3)  # only 2 instances of 3g


def re_escape(text: str) -> str:
    import re

    return re.escape(text)
