"""Change a Slurm node's MIG layout: drain, wait for its GPU jobs, apply, re-export, restart, resume.

Slurm cannot repartition a GPU (it expects MIG devices to exist already), and gpusched cannot see
Slurm's jobs, so the order is what keeps jobs safe: the node is drained first and the layout only
changes once Slurm reports no GPU allocated on it; gpuschedd's own planner then still refuses to
destroy an instance that has processes on it.
"""

from __future__ import annotations

import contextlib
import shlex
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpusched.slurm.scontrol import NodeState, Scontrol, SlurmError

RELAYOUT_REASON = "gpusched relayout"  # not "gpusched: ": the health check must not resume it
_POLL_S = 0.2


class RelayoutError(Exception):
    """The relayout stopped; the message says where and what state the node was left in."""


def parse_layout(text: str) -> dict[int, list[str]]:
    """`0=3g.40gb,2g.20gb;1=none` -> {0: [...], 1: []}; ValueError naming the bad part."""
    out: dict[int, list[str]] = {}
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        gpu, eq, profiles = part.partition("=")
        if not eq or not gpu.strip().isdigit():
            raise ValueError(f"LAYOUT: {part!r} is not GPU=PROFILES (e.g. 0=3g.40gb,2g.20gb or 1=none)")
        names = [] if profiles.strip().lower() == "none" else [p.strip() for p in profiles.split(",") if p.strip()]
        if not names and profiles.strip().lower() != "none":
            raise ValueError(f"LAYOUT: GPU {gpu.strip()} has no profiles; write {gpu.strip()}=none for an empty GPU")
        out[int(gpu)] = names
    if not out:
        raise ValueError("LAYOUT is empty")
    return out


@dataclass
class Steps:
    """The side effects, injected so the order can be followed and tested: apply one GPU's layout
    (raising with the daemon's message), regenerate the config (returning the node's new Gres=
    value), and run an admin command line."""

    apply: Callable[[int, list[str]], None]
    export: Callable[[], str]
    command: Callable[[str], None]


def run_command(line: str, timeout_s: float = 120.0) -> None:
    try:
        done = subprocess.run(shlex.split(line), capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RelayoutError(f"`{line}`: {exc}") from None
    if done.returncode != 0:
        raise RelayoutError(f"`{line}` failed ({done.returncode}): {(done.stderr or done.stdout).strip()}")


def wait_for(scontrol: Scontrol, node: str, ok: Callable[[NodeState], bool], timeout_s: float, what: str) -> NodeState:
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        try:
            state = scontrol.node(node)
            if ok(state):
                return state
            last = f"state {state.state}, AllocTRES {state.alloc_tres or '-'}, Gres {state.gres}"
        except SlurmError as exc:  # slurmctld restarting: ask again
            last = str(exc)
        if time.monotonic() > deadline:
            raise RelayoutError(f"node {node}: {what} did not happen within {timeout_s:g}s (last: {last})")
        time.sleep(_POLL_S)


def relayout(node: str, layout: dict[int, list[str]], scontrol: Scontrol, steps: Steps, *, restart_slurmd: str,
             reconfigure: str, timeout_s: float, log: Callable[[str], None]) -> None:
    """Drain NODE, wait until no job holds a GPU there, apply `layout`, regenerate the config, restart
    slurmd, let the controller re-read it, and resume once the node reports the new GRES.

    If its GPU jobs do not end within `timeout_s`, nothing is changed and the node is resumed; on a
    failure after that the node stays drained with the reason, for an administrator."""
    reason = f"{RELAYOUT_REASON}: " + ";".join(f"{g}={','.join(p) or 'none'}" for g, p in sorted(layout.items()))
    scontrol.drain(node, reason)
    log(f"drained {node}: waiting for its GPU jobs to end")
    try:
        wait_for(scontrol, node, lambda s: not s.gpus_allocated, timeout_s, "the end of its GPU jobs")
    except RelayoutError as exc:  # nothing was changed: give the node back rather than leave it idle
        scontrol.resume(node)
        raise RelayoutError(f"{exc}; nothing changed, {node} resumed") from None
    try:
        for gpu, profiles in sorted(layout.items()):
            steps.apply(gpu, profiles)
            log(f"GPU {gpu}: layout {','.join(profiles) or 'none'} applied")
        gres = steps.export()
        log(f"configuration regenerated: Gres={gres}")
        steps.command(restart_slurmd)
        log(f"ran `{restart_slurmd}`")
        steps.command(reconfigure)
        log(f"ran `{reconfigure}`")
        wait_for(scontrol, node, lambda s: _same_gres(s.gres, gres) and "NOT_RESPONDING" not in s.state
                 and not s.state.startswith(("DOWN", "UNKNOWN")), timeout_s, f"registration with Gres={gres}")
    except Exception as exc:
        failed = f"{reason} FAILED: {exc}"[:250]
        with contextlib.suppress(SlurmError):  # the reason stays the old one; the node is drained all the same
            scontrol.drain(node, failed)
        raise RelayoutError(f"{exc}; node {node} left drained") from exc
    scontrol.resume(node)
    log(f"resumed {node}")


def _same_gres(reported: str, expected: str) -> bool:
    """Slurm prints Gres= with its own formatting (`gpu:1g.10gb:2(S:0)`); compare name:type:count sets."""
    def norm(text: str) -> set[str]:
        parts = (p.split("(")[0] for p in text.split(","))
        return {p for p in parts if p and p != "(null)" and not p.endswith(":0")}  # mps:<type>:0 offers nothing
    return norm(reported) == norm(expected)
