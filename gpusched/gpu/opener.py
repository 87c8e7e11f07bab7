"""Which GPU backend a node gets: NVIDIA (nvml.py) or AMD Instinct (amdsmi.py), simulated or real.

Kept out of both backends so that nvml.py stays the only door to pynvml and amdsmi.py the only door
to amdsmi: this module only decides which door to knock on. A `--sim` spec names its vendor by its
models (A100-40GB, H100-80GB, ... are NVIDIA; MI300X, MI325X are AMD); one spec may not mix them,
because the daemon runs one backend. On real hardware NVML is tried first, then amdsmi (also when NVML
loads but lists no GPU); when neither loads, the error names both reasons.
"""

from __future__ import annotations

from gpusched.gpu.amd_profiles import AMD_MODEL_KEYS
from gpusched.gpu.backend import GpuBackend, GpuError, GpuInvalidArgumentError
from gpusched.gpu.profiles import MODEL_KEYS

# What each backend is called in `gpusched gpus`, `doctor` and gpusched_build_info.
BACKEND_NAMES = {("nvidia", True): "sim", ("amd", True): "sim-amdsmi", ("nvidia", False): "nvml",
                 ("amd", False): "amdsmi"}
BOTH_HINT = ("no NVIDIA (NVML) or AMD (amdsmi) driver here; to try gpusched without GPUs run: "
             "gpuschedd --sim H100-80GB:2 (NVIDIA) or gpuschedd --sim MI300X:2 (AMD Instinct)")


def vendor_of_model(model: str) -> str | None:
    """"nvidia" or "amd" for a model key, None for one neither table knows."""
    if model in AMD_MODEL_KEYS:
        return "amd"
    if model in MODEL_KEYS:
        return "nvidia"
    return None


def models_of_spec(spec: str) -> list[str]:
    """The model keys a `MODEL[:COUNT][@MODE][,...]` spec names (counts and AMD start modes are left
    to the simulators)."""
    return [part.strip().partition("@")[0].partition(":")[0].strip() for part in spec.split(",") if part.strip()]


def mixed_vendors(models: list[str]) -> str | None:
    """Why a node of these models cannot be (`mixes NVIDIA (..) and AMD (..) models; ...`), or None
    when they are one vendor's. Used by `--sim` here and by replay's `--gpus`."""
    amd = [m for m in dict.fromkeys(models) if m in AMD_MODEL_KEYS]
    nvidia = [m for m in dict.fromkeys(models) if m not in AMD_MODEL_KEYS]
    if amd and nvidia:
        return (f"mixes NVIDIA ({', '.join(nvidia)}) and AMD ({', '.join(amd)}) models; a node runs one GPU "
                "backend")
    return None


def vendor_of_spec(spec: str) -> str:
    """The one vendor a `--sim` / `--gpus` spec names. ValueError for a spec that mixes NVIDIA and
    AMD models (one node runs one backend) or names a model neither table knows."""
    models = models_of_spec(spec)
    for model in models:
        if vendor_of_model(model) is None:
            raise ValueError(f"unknown GPU model {model!r}; valid models: {', '.join(MODEL_KEYS + AMD_MODEL_KEYS)}")
    mixed = mixed_vendors(models)
    if mixed is not None:
        raise ValueError(f"{spec!r} {mixed}, so simulate one vendor at a time")
    if not models:
        raise ValueError("empty simulated GPU spec; e.g. H100-80GB:2 or MI300X:2")
    return "amd" if models[0] in AMD_MODEL_KEYS else "nvidia"


def open_gpu(sim_spec: str | None) -> tuple[GpuBackend, str]:
    """The backend and its display name: the simulator of the spec's vendor, else the real driver
    (NVML first, then amdsmi). GpuError with a hint when nothing can be opened."""
    from gpusched.gpu.amdsmi import open_amd_backend  # the only door to amdsmi
    from gpusched.gpu.nvml import open_backend  # the only door to NVML

    if sim_spec:
        try:
            vendor = vendor_of_spec(sim_spec)
        except ValueError as err:
            raise GpuInvalidArgumentError(str(err), hint="e.g. --sim H100-80GB:2 or --sim MI300X:2") from None
        backend: GpuBackend = open_amd_backend(sim_spec) if vendor == "amd" else open_backend(sim_spec)
        return backend, BACKEND_NAMES[(vendor, True)]
    try:
        nvidia = open_backend(None)
    except (GpuError, ImportError) as nvml_err:
        nvml_why = nvml_err.message if isinstance(nvml_err, GpuError) else f"cannot import pynvml: {nvml_err}"
    else:
        if _gpu_count(nvidia) != 0:
            return nvidia, BACKEND_NAMES[("nvidia", False)]
        # NVML loaded but sees no GPU (a driver package on an AMD node): amdsmi gets its turn, and
        # NVML is kept only when amdsmi finds nothing either (the daemon then serves zero GPUs)
        try:
            amd = open_amd_backend(None)
        except GpuError:
            return nvidia, BACKEND_NAMES[("nvidia", False)]
        if _gpu_count(amd) == 0:
            amd.close()
            return nvidia, BACKEND_NAMES[("nvidia", False)]
        nvidia.close()
        return amd, BACKEND_NAMES[("amd", False)]
    try:
        return open_amd_backend(None), BACKEND_NAMES[("amd", False)]
    except GpuError as amd_err:
        raise GpuError(f"no GPU driver could be opened: NVIDIA: {nvml_why}; AMD: {amd_err.message}",
                       hint=BOTH_HINT) from None


def _gpu_count(backend: GpuBackend) -> int | None:
    """How many GPUs a freshly opened backend lists; None when it cannot say (it is kept: the
    daemon's own inventory reports the error)."""
    try:
        return len(backend.inventory().gpus)
    except GpuError:
        return None
