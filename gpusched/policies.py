"""Policies by name: the built-ins and a site's own `package.module:Class`, through one door.

`load_policy(spec)` turns what `[scheduler] policy` or `gpusched replay --policy` says into a
`PolicyFactory`; `factory.make(context)` builds the policy. A built-in name is an alias for a
`module:function` target resolved exactly as a plug-in is (`BUILTINS`), so a site's class and
gpusched's own go through the same import, the same checks and the same `Class(context)` call.
Every problem is a PolicyError whose message names the field and what is wrong with it
(docs/policies.md).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpusched.config_sections import BUILTIN_POLICIES
from gpusched.core.fifo import FifoScheduler
from gpusched.core.scheduler import Scheduler
from gpusched.policy import Incremental, Policy, PolicyContext

__all__ = ["BUILTINS", "PolicyError", "PolicyFactory", "fair_share", "fifo", "load_policy"]


class PolicyError(ValueError):
    """A policy that cannot be used; the message names the field it came from and the problem."""


def fair_share(context: PolicyContext) -> Scheduler:
    """`gpusched`: the production fair-share scheduler (core/scheduler.py), keeping its own queue."""
    return Scheduler(context.scheduler, incremental=True)


def fifo(context: PolicyContext) -> FifoScheduler:
    """`fifo-whole` and `static-mig`: v1 first come, first served over whole devices (core/fifo.py)."""
    return FifoScheduler()


@dataclass(frozen=True, slots=True)
class _Builtin:
    target: str  # module:attribute, resolved like a plug-in
    daemon: bool  # gpuschedd may run it (the baselines need the replay's node set-up: see `why_not_daemon`)


BUILTINS: dict[str, _Builtin] = {
    "gpusched": _Builtin("gpusched.policies:fair_share", daemon=True),
    "fifo-whole": _Builtin("gpusched.policies:fifo", daemon=False),
    "fifo-timeslice": _Builtin("gpusched.replay.policies:timeslice_fifo", daemon=False),
    "static-mig": _Builtin("gpusched.policies:fifo", daemon=False),
}
assert tuple(BUILTINS) == BUILTIN_POLICIES  # (config_sections.py checks the form without importing the core)

_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*"
_SPEC = re.compile(rf"({_DOTTED}):({_DOTTED})")


@dataclass(frozen=True, slots=True)
class PolicyFactory:
    """A policy that loaded and passed its checks; `make` builds an instance (each replay its own)."""

    spec: str  # as written: a built-in name or package.module:Class
    name: str  # shown by replay and the daemon's log: the built-in name, the class's `name`, or the spec
    target: Callable[..., Any]
    builtin: bool
    daemon: bool  # gpuschedd may run it
    field: str

    def make(self, context: PolicyContext) -> Policy:
        """`target(context)`, checked: PolicyError if it raises or what it returns cannot plan."""
        try:
            policy = self.target(context)
        except Exception as exc:
            raise PolicyError(f"{self.field}: {self.spec!r} could not be constructed: {_exc_text(exc)}") from exc
        if not callable(getattr(policy, "plan", None)):
            raise PolicyError(f"{self.field}: {self.spec!r} built a {type(policy).__name__} without a "
                              "plan(snapshot, now) method; every policy needs one (docs/policies.md)")
        if getattr(policy, "incremental", False) and not isinstance(policy, Incremental):
            raise PolicyError(f"{self.field}: {self.spec!r} says incremental = True but lacks submit(job) or "
                              "remove(job_id), which a policy keeping its own queue must have (docs/policies.md)")
        return policy  # type: ignore[no-any-return]  # (checked above: it has plan)

    def why_not_daemon(self) -> str | None:
        """Why gpuschedd cannot run this policy, or None."""
        if self.daemon:
            return None
        return (f"{self.field}: {self.spec!r} is a replay baseline only (it relies on the replay's node set-up: "
                "whole GPUs or fixed layouts, shares rounded up); gpuschedd runs \"gpusched\" or a plug-in "
                "(package.module:Class)")


def load_policy(spec: object, field: str = "scheduler.policy") -> PolicyFactory:
    """A built-in name or `package.module:Class` -> its factory; PolicyError names `field` and the problem."""
    if not isinstance(spec, str) or not spec.strip():
        raise PolicyError(f"{field}: give a built-in policy ({', '.join(BUILTINS)}) or package.module:Class, "
                          f"not {spec!r}")
    spec = spec.strip()
    builtin = BUILTINS.get(spec)
    if builtin is not None:
        target = _resolve(builtin.target, spec, field)
        return PolicyFactory(spec, spec, target, True, builtin.daemon, field)
    target = _resolve(spec, spec, field)
    name = getattr(target, "name", None)
    return PolicyFactory(spec, name if isinstance(name, str) and name else spec, target, False, True, field)


def _resolve(target: str, spec: str, field: str) -> Callable[..., Any]:
    match = _SPEC.fullmatch(target)
    if match is None:
        raise PolicyError(f"{field}: {spec!r} is neither a built-in policy ({', '.join(BUILTINS)}) nor of the form "
                          "package.module:Class")
    module_name, attr_path = match.groups()
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or whatever the module raised while it ran
        raise PolicyError(f"{field}: cannot import module {module_name!r} for policy {spec!r}: "
                          f"{_exc_text(exc)}") from exc
    obj: Any = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise PolicyError(f"{field}: module {module_name!r} has no attribute {attr_path!r} (policy {spec!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise PolicyError(f"{field}: {spec!r} is a {type(obj).__name__}, not a policy class (or a function "
                          "returning a policy)")
    if isinstance(obj, type) and not callable(getattr(obj, "plan", None)):
        raise PolicyError(f"{field}: class {spec!r} has no plan(snapshot, now) method; every policy needs one "
                          "(docs/policies.md)")
    return obj  # type: ignore[no-any-return]  # (checked: callable)


def _exc_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
