"""The replay config file (`gpusched replay --config`): the policy knobs, the interference model and
the node set-up, read from TOML with every error naming the file, section and key (docs/replay.md,
"Config file"). The policies that read it are in policies.py.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, get_type_hints

from pydantic import BaseModel, TypeAdapter, ValidationError

from gpusched.config import ConfigError, read_config_text
from gpusched.config_sections import FairnessSection, MigSection, SchedulerSection
from gpusched.core.estimate import EstimatorConfig
from gpusched.core.fairshare import FairnessConfig
from gpusched.core.migplan import MigPolicy
from gpusched.core.scheduler import SchedulerConfig

STATIC_CLASSES: tuple[str, ...] = ("1g", "2g", "3g", "whole")


class ReplayConfigError(ValueError):
    """The replay config file is unusable; the message names the file, section and key."""


@dataclass(frozen=True, slots=True)
class Interference:
    """How fast a job runs on what it was given (docs/replay.md, "Interference model").

    A job's trace duration is its run time at speed 1: alone on what it asked for. Whole GPUs and
    MIG instances run at speed 1. k >= 2 jobs time-sliced on one device each run at
    (1 - timeslice_overhead) / k. MPS clients sharing a device run at 1 - mps_slowdown. A MIG
    create or destroy keeps its GPU's changed slices busy for mig_create_s / mig_destroy_s (operations
    on one GPU are serial), and a job started on a new instance makes no progress until it exists.

    Defaults come from published measurements (sources and exact figures in docs/replay.md), not
    from what flatters sharing:
    - mps_slowdown 0.15: seven measured MPS clients sharing a GPU with one other client lost 6.6-33.8 %
      of their speed against running alone on the same share (median 12.3 %, mean 18.6 %): NVIDIA
      developer forum threads 312930 (50 %/50 %: +10 % and +40 % latency) and 326201 (DenseNet121, 10/90 and 20/80 %:
      +48/+7 % and +51/+14 %), and a vLLM A100 case study (two clients: -7.5 % throughput). Under
      memory contention ~30 % (Villarrubia et al., arXiv 2604.22430), which is the sensitivity "high".
    - timeslice_overhead 0.20: NVIDIA's A100 benchmark of two models time-sliced on one GPU gave 0.76
      requests/s per GPU against 1.00 with MIG (24 % less); the 10 % used before is the low end of a
      vendor's unmeasured 10-30 % claim. No measurement of the slice lengths themselves is published.
    """

    timeslice_overhead: float = 0.20
    mps_slowdown: float = 0.15
    mig_create_s: float = 2.0
    mig_destroy_s: float = 1.0
    checkpoint_restore_s: float = 10.0  # a checkpointed job's GPU state copied back (80 GB at ~8 GB/s)
    mig_mode_s: float = 10.0  # a MIG mode switch of an idle GPU (a GPU reset; no published figure)

    def __post_init__(self) -> None:
        for name in ("timeslice_overhead", "mps_slowdown", "mig_create_s", "mig_destroy_s", "checkpoint_restore_s",
                     "mig_mode_s"):
            if not math.isfinite(getattr(self, name)):  # a NaN time would stop the simulated clock
                raise ValueError(f"{name} must be a finite number")
        if not 0 <= self.timeslice_overhead < 1 or not 0 <= self.mps_slowdown < 1:
            raise ValueError("timeslice_overhead and mps_slowdown must be in [0, 1)")
        if min(self.mig_create_s, self.mig_destroy_s, self.checkpoint_restore_s, self.mig_mode_s) < 0:
            raise ValueError("mig_create_s, mig_destroy_s, checkpoint_restore_s and mig_mode_s must be >= 0")


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """Everything a replay can be told besides the trace: policy knobs and the interference model."""

    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    interference: Interference = field(default_factory=Interference)
    mig_gpus: int | None = None  # gpusched: dynamic-MIG GPUs; None = sized from the trace
    # gpusched: mode of the MIG-off GPUs for shares; None: mps on NVIDIA, timeslice on AMD (replay/vendor.py)
    share_mode: Literal["mps", "timeslice"] | None = None
    checkpoint: bool = True  # gpusched: the node has cuda-checkpoint (driver r550+), so preemption keeps work
    mig_max_waste: float = 0.05  # gpusched: serve a flexible share with MIG if it wastes <= this
    timeslice_replicas: int = 4  # fifo-timeslice: jobs per GPU at most
    static_layouts: tuple[str, ...] | None = None  # static-mig: class per GPU; None = sized from trace
    policy_options: Mapping[str, Any] = field(default_factory=dict)  # [scheduler.policy_options], for plug-ins


_SECTIONS = {"fairness", "scheduler", "mig", "estimator", "replay", "interference"}


def load_config(path: str | None) -> ReplayConfig:
    """Read a replay TOML (docs/replay.md, "Config file"); None gives the defaults."""
    if path is None:
        return ReplayConfig()
    try:
        data = tomllib.loads(read_config_text(path))
    except OSError as exc:
        raise ReplayConfigError(f"{path}: cannot read config file: {exc.strerror}") from None
    except ConfigError as exc:
        raise ReplayConfigError(str(exc)) from None
    except UnicodeDecodeError as exc:
        raise ReplayConfigError(f"{path}: not valid UTF-8 (byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ReplayConfigError(f"{path}: not valid TOML: {exc}") from None
    return config_from_dict(data, source=path)


def config_from_dict(data: Mapping[str, Any], source: str = "config") -> ReplayConfig:
    """Build a ReplayConfig from parsed TOML, naming `source`, section and key in every error."""
    for key in data:
        if key not in _SECTIONS:
            raise ReplayConfigError(f"{source}: unknown section [{key}] (known: {', '.join(sorted(_SECTIONS))})")
    try:
        fair = _build(FairnessConfig, data.get("fairness", {}), "fairness", source)
        mig = _build(MigPolicy, data.get("mig", {}), "mig", source)
        estimator = _build(EstimatorConfig, data.get("estimator", {}), "estimator", source)
        sched_kw = dict(data.get("scheduler", {}))
        options = sched_kw.pop("policy_options", {})
        if not isinstance(options, Mapping):
            raise ReplayConfigError(f"{source}: [scheduler.policy_options] must be a table")
        for bad in ("fairness", "mig", "estimator"):
            if bad in sched_kw:
                raise ReplayConfigError(f"{source}: [scheduler] {bad}: use the [{bad}] section")
        sched = _build(SchedulerConfig, {**sched_kw, "fairness": fair, "mig": mig, "estimator": estimator},
                       "scheduler", source)
        interference = _build(Interference, data.get("interference", {}), "interference", source)
        rep = dict(data.get("replay", {}))
        if "policy_options" in rep:
            raise ReplayConfigError(f"{source}: [replay] policy_options: use the [scheduler.policy_options] table")
        mig_gpus = rep.pop("mig_gpus", "auto")
        layouts = rep.pop("static_layouts", None)
        cfg = _build(ReplayConfig, {**rep, "scheduler": sched, "interference": interference,
                                    "policy_options": dict(options)}, "replay", source)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ReplayConfigError):
            raise
        raise ReplayConfigError(f"{source}: {exc}") from None
    if mig_gpus != "auto":
        if not isinstance(mig_gpus, int) or isinstance(mig_gpus, bool) or mig_gpus < 0:
            raise ReplayConfigError(f"{source}: [replay] mig_gpus must be \"auto\" or a whole number >= 0")
        cfg = replace(cfg, mig_gpus=mig_gpus)
    if layouts is not None:
        if not isinstance(layouts, list) or any(x not in STATIC_CLASSES for x in layouts):
            raise ReplayConfigError(f"{source}: [replay] static_layouts must list one of "
                                    f"{', '.join(STATIC_CLASSES)} per GPU")
        cfg = replace(cfg, static_layouts=tuple(layouts))
    if not isinstance(cfg, ReplayConfig):
        raise ReplayConfigError(f"{source}: internal error building the config")
    if cfg.share_mode not in ("mps", "timeslice", None):
        raise ReplayConfigError(f"{source}: [replay] share_mode must be \"mps\" or \"timeslice\"")
    if cfg.timeslice_replicas < 1:
        raise ReplayConfigError(f"{source}: [replay] timeslice_replicas must be >= 1")
    return cfg


# The daemon's sections hold the ranges of the keys the two files share (config_sections.py); the
# replay's [estimator] names its keys after EstimatorConfig, the daemon's [scheduler] after itself.
_DAEMON_SECTIONS: dict[str, tuple[type[BaseModel], dict[str, str]]] = {
    "fairness": (FairnessSection, {}),
    "scheduler": (SchedulerSection, {}),
    "mig": (MigSection, {}),
    "estimator": (SchedulerSection, {"history": "estimate_history", "elapsed_factor": "estimate_elapsed_factor"}),
}
_NESTED = {"scheduler", "interference", "fairness", "mig", "estimator", "policy_options"}


def _build(cls: Any, values: Any, section: str, source: str) -> Any:
    if not isinstance(values, Mapping):
        raise ReplayConfigError(f"{source}: [{section}] must be a table")
    known = {f.name for f in fields(cls)}
    extra = (set(values) - known) - ({"mig_gpus", "static_layouts"} if cls is ReplayConfig else set())
    if extra:
        shown = sorted(known - _NESTED)
        raise ReplayConfigError(f"{source}: [{section}] unknown key(s): {', '.join(sorted(extra))} "
                                f"(known: {', '.join(shown)})")
    _check_values(cls, values, section, source)
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise ReplayConfigError(f"{source}: [{section}] {exc}") from None


def _check_values(cls: Any, values: Mapping[str, Any], section: str, source: str) -> None:
    """Each key's value: of its field's type, strictly ("no" is not a flag, "x" not a number, 1.5
    not a count), finite, and in the range the daemon's own section gives the same key."""
    hints = get_type_hints(cls)
    daemon, renamed = _DAEMON_SECTIONS.get(section, (None, {}))
    for key, value in values.items():
        if key in _NESTED:
            continue  # a section of its own, built (and checked) before
        try:
            TypeAdapter(hints[key]).validate_python(value, strict=True)
        except ValidationError as exc:
            raise ReplayConfigError(f"{source}: [{section}] {key}: {exc.errors()[0]['msg']}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise ReplayConfigError(f"{source}: [{section}] {key}: must be a finite number, not {value}")
        name = renamed.get(key, key)
        if daemon is not None and name in daemon.model_fields:
            try:
                daemon.model_validate({name: value}, strict=True)
            except ValidationError as exc:
                raise ReplayConfigError(f"{source}: [{section}] {key}: {exc.errors()[0]['msg']}") from None
