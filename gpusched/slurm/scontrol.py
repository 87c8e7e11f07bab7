"""The one door to Slurm's `scontrol`: run it with a deadline and parse `show node` output.

Every Slurm call goes through here so the daemon, the hooks and the CLI agree on how Slurm is
reached (which slurm.conf, which program) and a hung controller costs a timeout, never a hang.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from dataclasses import dataclass


class SlurmError(Exception):
    """scontrol failed or could not be run; the message has its output."""


@dataclass(frozen=True)
class NodeState:
    """What `scontrol show node` says about one node (only the fields we act on)."""

    name: str
    state: str  # e.g. "IDLE", "MIXED+DRAIN", "IDLE+DRAIN"
    reason: str
    gres: str
    alloc_tres: str
    gres_used: str = ""  # `-d` only: gpu:3g.40gb:1(IDX:2),gpu:a100:0(IDX:N/A),mps:0

    @property
    def drain(self) -> bool:
        return "DRAIN" in self.state.split("+")

    @property
    def gpus_allocated(self) -> bool:
        """A job holds a GPU, a MIG slice or a share here. GresUsed is what counts: AllocTRES names
        gres/gpu only when AccountingStorageTRES tracks it, so it alone would miss jobs."""
        if any(part.startswith(("gres/gpu", "gres/mps", "gres/shard")) for part in self.alloc_tres.split(",")):
            return True
        for item in re.split(r",(?![^(]*\))", self.gres_used):  # commas inside (IDX:0,2) are not separators
            count = item.split("(")[0].rsplit(":", 1)[-1]
            if item.startswith(("gpu", "mps", "shard")) and count.isdigit() and int(count) > 0:
                return True
        return False


@dataclass(frozen=True)
class Scontrol:
    """How to call scontrol: the program, the slurm.conf (SLURM_CONF), and the deadline per call."""

    program: str = "scontrol"
    slurm_conf: str | None = None
    timeout_s: float = 10.0

    def run(self, *args: str) -> str:
        env = dict(os.environ)
        if self.slurm_conf is not None:
            env["SLURM_CONF"] = self.slurm_conf
        argv = [self.program, *args]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=self.timeout_s, check=False)
        except FileNotFoundError:
            raise SlurmError(f"{self.program!r} not found; install Slurm's client tools "
                             "or set slurm.scontrol") from None
        except subprocess.TimeoutExpired:
            raise SlurmError(f"`{shlex.join(argv)}` timed out after {self.timeout_s:g}s") from None
        if done.returncode != 0:
            raise SlurmError(f"`{shlex.join(argv)}` failed ({done.returncode}): "
                             f"{(done.stderr or done.stdout).strip()}")
        return done.stdout

    def node(self, name: str) -> NodeState:
        return parse_node(name, self.run("-d", "show", "node", name, "--oneliner"))

    def drain(self, name: str, reason: str) -> None:
        self.run("update", f"nodename={name}", "state=drain", f"reason={reason}")

    def resume(self, name: str) -> None:
        self.run("update", f"nodename={name}", "state=resume")


def parse_node(name: str, text: str) -> NodeState:
    """Fields of `scontrol show node NAME --oneliner`. Reason= runs to the end of the line minus its
    `[user@time]` suffix, since a reason may contain spaces and `=`."""
    line = next((ln for ln in text.splitlines() if ln.startswith(f"NodeName={name} ")), "")
    if not line:
        raise SlurmError(f"scontrol knows no node {name!r}: {text.strip()[:200]}")
    fields: dict[str, str] = {}
    head, sep, reason = line.partition(" Reason=")
    for token in head.split():
        key, eq, value = token.partition("=")
        if eq:
            fields[key] = value
    if sep:
        reason = reason.strip()
        if reason.endswith("]") and " [" in reason:
            reason = reason[: reason.rindex(" [")]
    return NodeState(name=name, state=fields.get("State", ""), reason=reason if sep else "",
                     gres=fields.get("Gres", ""), alloc_tres=fields.get("AllocTRES", ""),
                     gres_used=fields.get("GresUsed", ""))
