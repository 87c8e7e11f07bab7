"""Compare what the NVIDIA driver answers with what gpusched's simulator answers, fact by fact.

Run it on a machine with a real GPU (as root to see the MIG layout; unprivileged runs compare what an
unprivileged daemon would see):

    python -m gpusched.tools.hardware_check            # prints the differences; exit 1 if any
    python -m gpusched.tools.hardware_check --json     # the same as JSON, to paste into an issue

It is read-only on the driver: every driver call goes through `NvmlBackend.query`, which refuses
anything but NVML getters, so it never changes MIG mode, instances or compute mode. It then builds a
simulator with the same models, the same MIG mode and the same GPU/compute instances (writes go to
the simulator only) and reads the same facts from it. `--driver-sim SPEC` reads a simulator in place
of the driver; it exists to test this script without a GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from gpusched.gpu.backend import GpuError
from gpusched.gpu.facts import Fact, existing_layout, read_facts
from gpusched.gpu.nvml import NvmlBackend, open_backend
from gpusched.gpu.simnvml import SimNVML


def _sim_like(
    driver: NvmlBackend, facts: dict[str, Fact], privileged: bool
) -> tuple[NvmlBackend, dict[int, int], list[str]]:
    """A simulator shaped like the driver's GPUs; (backend, sim index -> driver index, problems)."""
    problems: list[str] = []
    index_map: dict[int, int] = {}
    models: list[str] = []
    count = int(driver.query("nvmlDeviceGetCount"))
    for i in range(count):
        model = str(facts[f"gpu{i}.model"])
        if model == "no table":
            problems.append(f"gpu{i}: no simulator table for {facts[f'gpu{i}.name']!r}; not compared")
            continue
        index_map[len(models)] = i
        models.append(model)
    sim = SimNVML(models, seed=0)
    sim.nvmlInit()
    layout = existing_layout(driver)
    for s_idx, d_idx in index_map.items():
        h = sim.nvmlDeviceGetHandleByIndex(s_idx)
        mode = facts[f"gpu{d_idx}.mig_mode"]
        if isinstance(mode, tuple) and mode[0]:
            sim.nvmlDeviceSetMigMode(h, 1)
        for profile_id, start, ci_enum in layout.get(d_idx, []):
            problems.extend(_rebuild(sim, h, d_idx, profile_id, start, ci_enum))
    sim.set_privileged(privileged)
    return NvmlBackend(sim, init=False), index_map, problems


def _rebuild(sim: SimNVML, h: Any, d_idx: int, profile_id: int, start: int, ci_enum: int) -> list[str]:
    """Create one of the driver's instances on the simulator; a refusal is itself a difference."""
    try:
        p = sim.c_nvmlGpuInstancePlacement_t()
        info = sim.nvmlDeviceGetGpuInstanceProfileInfoById(h, profile_id)
        p.start = start
        p.size = _size(sim, h, profile_id, start)
        gi = _find_gi(sim, h, profile_id, start, info)
        if gi is None:
            gi = sim.nvmlDeviceCreateGpuInstanceWithPlacement(h, profile_id, p)
        if ci_enum >= 0:
            sim.nvmlGpuInstanceCreateComputeInstance(gi, ci_enum)
    except sim.NVMLError as err:
        what = f"GI profile id {profile_id} at {start}" + (f" with CI profile {ci_enum}" if ci_enum >= 0 else "")
        return [f"gpu{d_idx}: the driver has {what}; the simulator refuses it: {type(err).__name__}"]
    return []


def _size(sim: SimNVML, h: Any, profile_id: int, start: int) -> int:
    arr = (sim.c_nvmlGpuInstancePlacement_t * 16)()
    count = ctypes.c_uint(0)
    sim.nvmlDeviceGetGpuInstancePossiblePlacements(h, profile_id, arr, ctypes.byref(count))
    for i in range(count.value):
        if arr[i].start == start:
            return int(arr[i].size)
    return 0  # the create call then refuses it, which is reported


def _find_gi(sim: SimNVML, h: Any, profile_id: int, start: int, info: Any) -> Any:
    arr = (sim.c_nvmlGpuInstance_t * max(1, int(info.instanceCount)))()
    count = ctypes.c_uint(0)
    sim.nvmlDeviceGetGpuInstances(h, profile_id, arr, ctypes.byref(count))
    for k in range(count.value):
        if int(sim.nvmlGpuInstanceGetInfo(arr[k]).placement.start) == start:
            return arr[k]
    return None


def compare(driver: NvmlBackend, *, privileged: bool) -> dict[str, Any]:
    """{"driver": facts, "differences": [{"fact", "driver", "simulator"}], "problems": [...]}."""
    facts = read_facts(driver)
    sim, index_map, problems = _sim_like(driver, facts, privileged)
    try:
        raw = read_facts(sim)
    finally:
        sim.close()
    sim_facts: dict[str, Fact] = {}
    for key, value in raw.items():
        gpu, _, rest = key.partition(".")
        sim_facts[f"gpu{index_map[int(gpu.removeprefix('gpu'))]}.{rest}"] = value
    compared = {k.partition(".")[0] for k in sim_facts}
    notes: list[str] = []
    if not privileged:
        # The layout cannot be read without root, so the simulator cannot be given the same instances:
        # the MIG devices they would create are not comparable.
        notes.append("not root: the MIG layout cannot be read (nvml.h: GetGpuInstances requires privileged "
                     "user), so MIG device facts are not compared; run as root for a full check")

    def comparable(key: str) -> bool:
        return key.partition(".")[0] in compared and (privileged or ".mig_device" not in key)

    diffs = [
        {"fact": k, "driver": _jsonable(facts.get(k, "absent")), "simulator": _jsonable(sim_facts.get(k, "absent"))}
        for k in sorted(set(facts) | set(sim_facts))
        if comparable(k) and facts.get(k, "absent") != sim_facts.get(k, "absent")
    ]
    return {"driver": {k: _jsonable(v) for k, v in facts.items()}, "differences": diffs, "problems": problems,
            "notes": notes, "compared": sum(1 for k in facts if comparable(k))}


def _jsonable(value: Any) -> Any:
    return [_jsonable(v) for v in value] if isinstance(value, tuple) else value


def main(argv: Sequence[str] | None = None, *, driver_module: Any = None) -> int:
    """Exit 0: no difference; 1: differences (printed); 2: the driver could not be read."""
    ap = argparse.ArgumentParser(prog="python -m gpusched.tools.hardware_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print facts and differences as JSON")
    ap.add_argument("--driver-sim", metavar="SPEC", help="read this simulator instead of the driver (tests)")
    args = ap.parse_args(argv)
    try:
        driver = NvmlBackend(driver_module) if driver_module is not None else open_backend(args.driver_sim)
    except GpuError as err:
        print(f"error: {err.message}" + (f" ({err.hint})" if err.hint else ""), file=sys.stderr)
        return 2
    privileged = os.geteuid() == 0 if driver_module is None and not args.driver_sim else True
    privileged = bool(getattr(driver.module, "privileged", privileged))
    try:
        result = compare(driver, privileged=privileged)
    finally:
        driver.close()
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        for line in result["notes"]:
            print(f"NOTE {line}")
        for line in result["problems"]:
            print(f"PROBLEM {line}")
        for d in result["differences"]:
            print(f"DIFF {d['fact']}: driver={d['driver']!r} simulator={d['simulator']!r}")
        print(f"{result['compared']} driver facts compared, {len(result['differences'])} differ, "
              f"{len(result['problems'])} problems")
    return 1 if result["differences"] or result["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
