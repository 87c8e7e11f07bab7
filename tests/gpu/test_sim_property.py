"""Property: no sequence of creates/destroys on the simulator overlaps placements or breaks caps."""

from __future__ import annotations

import ctypes
from typing import Any

import pynvml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpusched.gpu.profiles import MEMORY_SLICES, MODEL_KEYS, profiles_for
from gpusched.gpu.simnvml import SimNVML

# (kind, profile index, start index or -1 for the driver's default placement, victim index)
ops = st.lists(
    st.tuples(st.sampled_from(["create", "destroy"]), st.integers(0, 6), st.integers(-1, 6), st.integers(0, 20)),
    max_size=25,
)


def _state(s: SimNVML, h: Any, model: str) -> list[tuple[int, int, int]]:
    """(profile id, start, size) of every GI, read back through the API."""
    out = []
    for p in profiles_for(model):
        arr = (pynvml.c_nvmlGpuInstance_t * 8)()
        count = ctypes.c_uint()
        s.nvmlDeviceGetGpuInstances(h, p.profile_id, arr, ctypes.byref(count))
        assert count.value <= p.max_instances
        for i in range(count.value):
            info = s.nvmlGpuInstanceGetInfo(arr[i])
            out.append((int(info.profileId), int(info.placement.start), int(info.placement.size)))
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=st.sampled_from(MODEL_KEYS), seq=ops, seed=st.integers(0, 1000))
def test_random_create_destroy_keeps_invariants(model: str, seq: list[tuple[str, int, int, int]], seed: int) -> None:
    s = SimNVML([model], seed=seed)
    s.nvmlInit()
    h = s.nvmlDeviceGetHandleByIndex(0)
    s.nvmlDeviceSetMigMode(h, 1)
    profs = profiles_for(model)
    gis: list[Any] = []
    for kind, pi, si, victim in seq:
        if kind == "destroy":
            if gis:
                s.nvmlGpuInstanceDestroy(gis.pop(victim % len(gis)))
            continue
        p = profs[pi]
        remaining = s.nvmlDeviceGetGpuInstanceRemainingCapacity(h, p.profile_id)
        try:
            if si < 0:
                gis.append(s.nvmlDeviceCreateGpuInstance(h, p.profile_id))
            else:
                pl = pynvml.c_nvmlGpuInstancePlacement_t(si, p.memory_slices)
                gis.append(s.nvmlDeviceCreateGpuInstanceWithPlacement(h, p.profile_id, ctypes.byref(pl)))
            assert remaining > 0, "created beyond the reported remaining capacity"
        except pynvml.NVMLError_InsufficientResources:
            assert si >= 0 or remaining == 0, "default placement failed although capacity was reported"
        except pynvml.NVMLError_InvalidArgument:
            assert si not in p.starts
        state = _state(s, h, model)
        cells = [c for _, start, size in state for c in range(start, start + size)]
        assert len(cells) == len(set(cells)) and all(0 <= c < MEMORY_SLICES for c in cells)
        assert len(state) == len(gis)
