"""In `mode = "slurm-node"`: keep the node's Slurm state in step with gpusched's device health.

A device drained by an XID, a lost GPU, or `gpusched gpus drain` drains the node in Slurm with the
reason (`gpusched: XID 79 on GPU 1`), so Slurm stops sending jobs to a broken GPU; when every
device is back (`gpusched gpus resume`), the node is resumed. Only drains whose reason starts with
`gpusched: ` are ever resumed here: an administrator's drain, or a relayout's, is never undone.

It reconciles rather than reacts: each check compares the two states, so a scontrol call that
failed (controller down) is simply retried on the next one.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpusched.slurm.scontrol import Scontrol, SlurmError

if TYPE_CHECKING:
    from gpusched.config import DaemonConfig
    from gpusched.daemon.engine import Engine

log = logging.getLogger("gpusched.slurm")

REASON_PREFIX = "gpusched: "
CHECK_INTERVAL_S = 2.0  # also checked at once when a GPU event wakes watchers


def node_name(config: DaemonConfig) -> str:
    return config.slurm.node_name or socket.gethostname().split(".")[0]


def scontrol_of(config: DaemonConfig) -> Scontrol:
    s = config.slurm
    return Scontrol(program=s.scontrol, slurm_conf=s.slurm_conf, timeout_s=s.timeout_s)


def drain_reason(engine: Engine) -> str | None:
    """Why the node should be drained in Slurm, or None when every GPU is in service."""
    inventory = engine.inventory
    index_of: dict[str, int] = {}
    for gpu in inventory.gpus:
        index_of[gpu.uuid] = gpu.index
        for inst in gpu.instances:
            index_of[inst.uuid] = gpu.index
    reasons: list[str] = []
    for uuid, rec in sorted(engine.devices.health.drained().items()):
        index = index_of.get(uuid)
        text = rec.reason.split(": ", 1)[1] if rec.reason.startswith(("gpu_fault: ", "gpu_lost: ")) else rec.reason
        where = f" on GPU {index}" if index is not None and f"GPU {index}" not in text else ""
        reasons.append(f"{text or 'drained'}{where}")
    for index, error in sorted(inventory.errors.items()):
        reasons.append(f"GPU {index} unreadable: {error}")
    if not reasons:
        return None
    unique = list(dict.fromkeys(reasons))
    return REASON_PREFIX + "; ".join(unique)[:200]


def reconcile(engine: Engine, config: DaemonConfig) -> str:
    """One check (blocking: scontrol runs here). Returns what was done, for the log."""
    name = node_name(config)
    scontrol = scontrol_of(config)
    want = drain_reason(engine)
    node = scontrol.node(name)
    ours = node.drain and node.reason.startswith(REASON_PREFIX)
    if want is not None:
        if node.drain and (not ours or node.reason == want):
            return ""  # already drained (by us with this reason, or by someone else: theirs wins)
        scontrol.drain(name, want)
        return f"drained {name} in Slurm: {want}"
    if ours:
        scontrol.resume(name)
        return f"resumed {name} in Slurm: every GPU is back in service"
    return ""


async def run(engine: Engine, config: Callable[[], DaemonConfig], interval_s: float = CHECK_INTERVAL_S) -> None:
    """Reconcile until cancelled: on every change the engine announces, and every `interval_s`."""
    last_error = ""
    while True:
        try:
            done = await asyncio.to_thread(reconcile, engine, config())
            if done:
                log.warning("%s", done)
            last_error = ""
        except SlurmError as exc:
            if str(exc) != last_error:  # a controller that is down would otherwise fill the log
                log.error("Slurm node state not checked: %s", exc)
            last_error = str(exc)
        except Exception:
            log.exception("Slurm node check failed")
        await engine.wait_for_change(interval_s)
