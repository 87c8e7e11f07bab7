"""The node's devices: gpus (drain, resume), mig apply, sim inject-xid."""

from __future__ import annotations

from typing import Any

import click

from gpusched_cli import messages, render
from gpusched_cli.common import connected, echo, print_json
from gpusched_cli.results import reading


@click.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="print the daemon's GpusResult (see docs/cli.md)")
@click.pass_context
def gpus(ctx: click.Context, as_json: bool) -> None:
    """The node's GPUs: memory, MIG mode and instances, health, and whose jobs run where.

    With a subcommand, an administrator drains a device or resumes it.
    """
    if ctx.invoked_subcommand is not None:
        return
    with connected(ctx) as client:
        result = client.request(messages.bare("gpus"))
    if as_json:
        print_json(result)
        return
    with reading("gpus", result):
        text = render.gpus_text(result)
    echo(text)


def _devices_changed(op: str, result: dict[str, Any]) -> None:
    with reading(op, result):
        lines = [str(result["message"])] + [f"  {uuid}" for uuid in result["devices"]]
    for line in lines:
        echo(line)


def _device_arg(ctx: click.Context, param: click.Parameter, value: str) -> str:
    if not value.strip():
        raise click.BadParameter("is empty; give a GPU index (0) or a GPU- or MIG- UUID", ctx, param)
    return value.strip()


@gpus.command("drain")
@click.argument("device", metavar="DEVICE", callback=_device_arg)
@click.option("--reason", default="", help="why, shown in `gpusched gpus`")
@click.pass_context
def gpus_drain(ctx: click.Context, device: str, reason: str) -> None:
    """Admin: no new job starts on DEVICE (GPU index, GPU- or MIG- UUID); running jobs continue."""
    with connected(ctx) as client:
        result = client.request(messages.gpu_drain(device, reason))
    _devices_changed("gpu_drain", result)


@gpus.command("resume")
@click.argument("device", metavar="DEVICE", callback=_device_arg)
@click.pass_context
def gpus_resume(ctx: click.Context, device: str) -> None:
    """Admin: put a drained DEVICE (GPU index, GPU- or MIG- UUID) back in service."""
    with connected(ctx) as client:
        result = client.request(messages.gpu_resume(device))
    _devices_changed("gpu_resume", result)


@click.group()
def mig() -> None:
    """MIG layouts (admin)."""


@mig.command("apply")
@click.argument("gpu", type=click.IntRange(min=0), metavar="GPU")
@click.argument("layout", metavar="LAYOUT")
@click.option("--dry-run", is_flag=True, help="show what would change, change nothing")
@click.option("--json", "as_json", is_flag=True, help="print the daemon's MigApplyResult")
@click.pass_context
def mig_apply(ctx: click.Context, gpu: int, layout: str, dry_run: bool, as_json: bool) -> None:
    """Make GPU hold exactly LAYOUT, e.g. `3g.40gb,2g.20gb,2g.20gb` (or `none`).

    Instances that already match are kept; only idle ones are destroyed; if a busy instance would
    have to go, nothing changes and the job holding it is named.
    """
    if layout.strip().lower() == "none":
        profiles: list[str] = []
    else:
        profiles = [p.strip() for p in layout.split(",")]
        if not all(profiles):  # "" or "3g.40gb,,1g.10gb": a slip, not a request to destroy every instance
            raise click.BadParameter("give a comma-separated list of profiles (e.g. 3g.40gb,2g.20gb) with "
                                     "no empty entries, or `none` to remove every instance", param_hint="'LAYOUT'")
    with connected(ctx) as client:
        result = client.request(messages.mig_apply(gpu, profiles, dry_run))
    if as_json:
        print_json(result)
        return
    verb = "would" if dry_run else "did"
    with reading("mig_apply", result):
        lines = [f"GPU {gpu}: keep {len(result['keep'])}, destroy {len(result['destroy'])}, "
                 f"create {len(result['create'])} ({'dry run' if dry_run else 'applied'})"]
        lines += [f"  {verb} destroy {uuid}" for uuid in result["destroy"]]
        lines += [f"  {verb} create {planned['profile']} at memory slice {planned['start']}"
                  for planned in result["create"]]
    for line in lines:
        echo(line)


@click.group()
def sim() -> None:
    """Simulated GPUs only (gpuschedd --sim): fault injection for trying out and testing."""


@sim.command("inject-xid")
@click.argument("gpu", type=click.IntRange(min=0), metavar="GPU")
@click.argument("xid", type=click.IntRange(1, 1000), metavar="XID")
@click.option("--gi", type=click.IntRange(min=0), help="scope to this MIG GPU instance id")
@click.option("--ci", type=click.IntRange(min=0), help="scope to this MIG compute instance id")
@click.option("--lost", is_flag=True, help="make the GPU fall off the bus instead")
@click.pass_context
def sim_inject_xid(ctx: click.Context, gpu: int, xid: int, gi: int | None, ci: int | None, lost: bool) -> None:
    """Admin: deliver XID on simulated GPU as the driver would (13, 31, 43, 45, 68, 109 are app errors)."""
    with connected(ctx) as client:
        result = client.request(messages.sim_inject_xid(gpu, xid, gi, ci, lost))
    with reading("sim_inject_xid", result):
        message = str(result["message"])
    echo(message)
