"""`gpusched slurm ...`: export a node's Slurm configuration, Slurm's job hooks, and relayout.

A command group of its own, registered by one line in main.COMMANDS. The
Slurm code (gpusched.slurm) is imported lazily, inside each command: `gpusched submit` must not
pay for it.
"""

from __future__ import annotations

import os
import re
import socket as socket_module
import sys
from typing import TYPE_CHECKING, Any

import click

from gpusched_cli.client import Client
from gpusched_cli.common import connected, target_of

if TYPE_CHECKING:
    from gpusched.slurm.scontrol import Scontrol

EXIT_SLURM = 1  # Slurm (scontrol, slurmd) or a file refused: the message says which


def _die(message: str, hint: str = "", code: int = EXIT_SLURM) -> None:
    click.echo(f"error: {message}", err=True)
    if hint:
        click.echo(f"hint: {hint}", err=True)
    sys.exit(code)


def _default_node() -> str:
    return socket_module.gethostname().split(".")[0]


@click.group()
def slurm() -> None:
    """Run this node's GPUs under Slurm (gpuschedd --mode slurm-node; see docs/slurm.md)."""


_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")  # a host name, as slurm.conf's NodeName


def _node_flag(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and not _NODE_NAME.match(value):
        raise click.BadParameter(f"{value!r} is not a node name (letters, digits, '.', '_', '-'; at most 64)",
                                 ctx, param)
    return value


def _node_params_flag(ctx: click.Context, param: click.Parameter, value: str) -> str:
    if any(ch < " " or ch == "\x7f" for ch in value):  # a newline would start a line of its own in slurm.conf
        raise click.BadParameter("must be one line, without control characters", ctx, param)
    return value


@slurm.command("export", short_help="Write the node's gres.conf, NodeName line, GRES map and hooks.")
@click.option("--node", default=None, callback=_node_flag,
              help="the node's NodeName in slurm.conf  [default: short host name]")
@click.option("--out", "out", type=click.Path(file_okay=False), default=None,
              help="write gres.conf, slurm-node.conf, gres-map.json, billing.txt and hooks/ here; else print them")
@click.option("--dev-root", default=None,
              help="where the device files are: /dev on real GPUs; with --sim, OUT/dev (created with mknod)")
@click.option("--node-params", default="", metavar="TEXT", callback=_node_params_flag,
              help="other NodeName= parameters for the fragment, e.g. 'NodeAddr=10.0.0.5 CPUs=64 RealMemory=512000'")
@click.option("--gres-conf", type=click.Path(dir_okay=False), default=None,
              help="also replace this node's block in this (shared) gres.conf")
@click.option("--slurm-conf", type=click.Path(dir_okay=False), default=None,
              help="also replace this node's NodeName block in this slurm.conf (or a file it Includes)")
@click.option("--run-dir", default="/run/gpusched-slurm", show_default=True,
              help="where the hooks keep job records and MPS pipe directories")
@click.option("--job-mapping-dir", default=None, help="the hooks write dcgm-exporter job-mapping files here")
@click.option("--mps-control", default=None,
              help="nvidia-cuda-mps-control for gres/mps jobs  [default: from PATH; with --sim, the simulated one]")
@click.option("--gres-mps", is_flag=True,
              help="also offer GPUs configured share = \"mps\" as gres/mps (Slurm 22.05: not on nodes or clusters "
              "with MIG GPUs, see docs/slurm.md)")
@click.option("--gres-shard", "gres_shards", type=click.IntRange(0, 1024), default=0, metavar="N",
              help="also offer each GPU configured share = \"mps\" as N gres/shard (same limits as --gres-mps)")
@click.pass_context
def slurm_export(ctx: click.Context, node: str | None, out: str | None, dev_root: str | None, node_params: str,
                 gres_conf: str | None, slurm_conf: str | None, run_dir: str, job_mapping_dir: str | None,
                 mps_control: str | None, gres_mps: bool, gres_shards: int) -> None:
    """The node's gres.conf, its `NodeName=... Gres=...` line, the GRES index -> UUID map, and
    TRESBillingWeights terms that charge a MIG slice by its share of the GPU's SMs.

    Typed GRES: a MIG instance is `gpu:<profile>` (MultipleFiles= with its nvidia-caps files), a
    whole GPU is `gpu:<model>` (File=); a GPU shared through MPS also offers `mps` (Count=100) with
    --gres-mps, and N `shard` with --gres-shard N. Every job on a GPU configured share = "mps" gets
    a per-user MPS control daemon.
    Records are grouped by type in the order Slurm numbers them. With --sim the device files are
    created with mknod under OUT/dev (root only): Slurm refuses plain files.
    """
    from gpusched.protocol import GpusRequest, GpusResult
    from gpusched.slurm import export, gresconf

    with connected(ctx) as client:
        result = client.call(GpusRequest(), GpusResult)
    node = node or _default_node()
    sim = result.backend == "sim"
    if out is None:
        try:
            devs = gresconf.devices(result, dev_root or "/dev", gres_mps, gres_shards)
        except ValueError as exc:
            _die(str(exc))
        _warn_mps_skipped(gresconf, result, devs, gres_mps or bool(gres_shards))
        click.echo(f"# gres.conf\n{gresconf.gres_conf(node, devs)}\n# slurm.conf\n"
                   f"{gresconf.node_line(node, devs, node_params)}\n# gres-map.json\n{gresconf.gres_map(node, devs)}"
                   f"\n# billing (partition TRESBillingWeights terms)\n{gresconf.billing_weights(result)}\n", nl=False)
        return
    out = os.path.abspath(out)
    if mps_control is None:
        mps_control = _sim_mps_control() if sim else "nvidia-cuda-mps-control"
    opts = export.ExportOptions(
        node=node, out=out, socket=target_of(ctx).path,
        dev_root=os.path.abspath(dev_root) if dev_root else (os.path.join(out, "dev") if sim else "/dev"),
        mknod=sim, node_params=node_params, gres_conf=_abs(gres_conf), slurm_conf=_abs(slurm_conf),
        run_dir=os.path.abspath(run_dir), job_mapping_dir=_abs(job_mapping_dir), mps_control=mps_control,
        gres_mps=gres_mps, gres_shards=gres_shards)
    try:
        devs = export.write_export(result, opts)
    except (OSError, ValueError) as exc:
        _die(str(exc))
    _warn_mps_skipped(gresconf, result, devs, gres_mps or bool(gres_shards))
    click.echo(f"{node}: {len(devs)} GPU device(s) -> {out} (gres.conf, slurm-node.conf, gres-map.json, hooks/)")
    click.echo(gresconf.node_line(node, devs, node_params), nl=False)


def _auto_layout(client: Client, node: str, out: str, scontrol: Scontrol, squeue_path: str) -> dict[int, list[str]]:
    """GPU -> layout for NODE from Slurm's pending MIG jobs (gpusched.slurm.autolayout)."""
    import json
    import subprocess
    from pathlib import Path

    from gpusched.protocol import GpusRequest, GpusResult
    from gpusched.slurm import autolayout, gresconf

    result = client.call(GpusRequest(), GpusResult)
    try:
        done = subprocess.run([squeue_path, "--json", "--states=PENDING"], capture_output=True, text=True,
                              timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ValueError(f"{squeue_path} --json: {exc}") from None
    if done.returncode != 0:
        raise ValueError(f"`{squeue_path} --json` failed ({done.returncode}): {done.stderr.strip()}")
    demand = autolayout.pending_demand(json.loads(done.stdout), autolayout.node_profiles(result))
    devs = gresconf.load_map(Path(out, "gres-map.json").read_text(encoding="utf-8"))
    busy = autolayout.busy_uuids(scontrol.node(node).gres_used, devs)
    layouts, unmet = autolayout.plan(result, demand, busy)
    for profile in unmet:
        click.echo(f"warning: no room on {node} for a pending {profile} job, even with every idle instance gone",
                   err=True)
    return layouts


def _abs(path: str | None) -> str | None:
    return os.path.abspath(path) if path is not None else None


def _sim_mps_control() -> str:
    import importlib.util

    spec = importlib.util.find_spec("gpusched.gpu.simmps")  # the path only; nothing of gpu/ runs here
    assert spec is not None and spec.origin is not None
    return spec.origin


@slurm.command("hook", short_help="Slurm's Prolog, TaskProlog or Epilog.")
@click.argument("kind", type=click.Choice(["prolog", "task-prolog", "epilog"]))
@click.option("--map", "map_path", required=True, help="gres-map.json written by `gpusched slurm export`")
@click.option("--run-dir", default="/run/gpusched-slurm", show_default=True, help="job records, MPS directories")
@click.option("--job-mapping-dir", default=None, help="dcgm-exporter job-mapping directory")
@click.option("--mps-control", default="nvidia-cuda-mps-control", show_default=True,
              help="MPS control program for jobs on share = \"mps\" GPUs")
def slurm_hook(kind: str, map_path: str, run_dir: str, job_mapping_dir: str | None, mps_control: str) -> None:
    """Slurm's Prolog, TaskProlog or Epilog (export writes scripts that run this).

    prolog (root): SLURM_JOB_GPUS -> device UUIDs, a per-user MPS control daemon for jobs on a
    share = "mps" GPU (gres/mps jobs included), dcgm job mapping. task-prolog (the job's user):
    prints `export CUDA_VISIBLE_DEVICES=<UUIDs>` (export's script prints the prolog's file instead).
    epilog (root): undoes the prolog. None of them fails the node: problems go to the job.
    """
    from gpusched.slurm import hooks

    cfg = hooks.HookConfig(map_path=map_path, run_dir=run_dir, job_mapping_dir=job_mapping_dir,
                           mps_control=mps_control)
    sys.exit(hooks.run(kind, cfg, os.environ))


def _warn_mps_skipped(gresconf: Any, result: Any, devs: Any, asked: bool) -> None:
    for why in gresconf.mps_skipped(result, devs) if asked else []:
        click.echo(f"warning: not offered as gres/mps or gres/shard: {why}", err=True)


@slurm.command("relayout", short_help="Change a node's MIG layout safely (drain, apply, resume).")
@click.argument("node", metavar="NODE")
@click.argument("layout", metavar="[LAYOUT]", required=False)
@click.option("--auto", is_flag=True, help="plan LAYOUT from the MIG jobs pending in Slurm (squeue --json)")
@click.option("--squeue", "squeue_path", default="squeue", show_default=True, help="squeue program (--auto)")
@click.option("--out", "out", required=True, type=click.Path(file_okay=False),
              help="the directory `gpusched slurm export --out` wrote for NODE (its options are reused)")
@click.option("--restart-slurmd", default="systemctl restart slurmd", show_default=True,
              help="command that restarts NODE's slurmd")
@click.option("--reconfigure", default="scontrol reconfigure", show_default=True,
              help="command that makes slurmctld re-read the Gres= of NODE (Slurm 22.05 needs a slurmctld restart "
              "for a changed GPU count: `systemctl restart slurmctld`)")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1), default=3600.0, show_default=True,
              help="seconds to wait for NODE's GPU jobs to end, and for slurmd to come back")
@click.option("--scontrol", "scontrol_path", default="scontrol", show_default=True, help="scontrol program")
@click.pass_context
def slurm_relayout(ctx: click.Context, node: str, layout: str | None, auto: bool, squeue_path: str, out: str,
                   restart_slurmd: str, reconfigure: str, timeout_s: float, scontrol_path: str) -> None:
    """Give NODE the MIG LAYOUT, e.g. `0=3g.40gb,2g.20gb,2g.20gb;1=none` (GPU=profiles, `;` between GPUs).

    Drains NODE in Slurm, waits until no job holds a GPU there, applies the layout through this
    node's gpuschedd (which never destroys a busy instance), regenerates the configuration as
    `export` did, restarts slurmd, lets the controller re-read it, and resumes NODE once it reports
    the new GRES. If its jobs do not end within --timeout, nothing changes and NODE is resumed; if
    a later step fails the node stays drained with the reason.

    With --auto instead of LAYOUT, the layout comes from the jobs Slurm has pending for MIG
    profiles NODE's GPUs offer: gpusched's demand-driven MIG planner keeps instances that are busy
    or still asked for, and makes room for the rest; with nothing pending that a layout would help,
    nothing is done (exit 0).
    """
    from gpusched.protocol import GpusRequest, GpusResult, MigApplyRequest, MigApplyResult, ProtocolError
    from gpusched.slurm import export, gresconf, relayout
    from gpusched.slurm.scontrol import Scontrol, SlurmError

    if (layout is None) == (not auto):
        _die("give either LAYOUT or --auto", code=2)
    try:
        wanted = relayout.parse_layout(layout) if layout is not None else {}
        opts = export.load_options(os.path.abspath(out))
    except ValueError as exc:
        _die(str(exc), code=2)
    if opts.node != node:
        _die(f"{out} was exported for node {opts.node!r}, not {node!r}", code=2)
    scontrol = Scontrol(program=scontrol_path)
    with connected(ctx) as client:
        if auto:
            try:
                wanted = _auto_layout(client, node, opts.out, scontrol, squeue_path)
            except (SlurmError, ValueError, OSError) as exc:
                _die(str(exc))
            if not wanted:
                click.echo(f"{node}: no pending MIG job a new layout would help; nothing changed")
                return
            click.echo("planned layout: " + ";".join(f"{g}={','.join(p) or 'none'}" for g, p in sorted(wanted.items())))
        for gpu, profiles in sorted(wanted.items()):  # refuse a bad layout before draining anything
            client.call(MigApplyRequest(gpu=gpu, layout=profiles, dry_run=True), MigApplyResult)

        def apply(gpu: int, profiles: list[str]) -> None:
            result = client.call(MigApplyRequest(gpu=gpu, layout=profiles), MigApplyResult)
            if not result.applied:
                raise relayout.RelayoutError(f"GPU {gpu}: layout not applied: {'; '.join(result.log)}")

        def regenerate() -> str:
            devs = export.write_export(client.call(GpusRequest(), GpusResult), opts)
            return gresconf.gres_spec(devs)

        steps = relayout.Steps(apply=apply, export=regenerate, command=relayout.run_command)
        try:
            relayout.relayout(node, wanted, scontrol, steps, restart_slurmd=restart_slurmd,
                              reconfigure=reconfigure, timeout_s=timeout_s, log=click.echo)
        except (relayout.RelayoutError, SlurmError) as exc:
            _die(str(exc))
        except ProtocolError as exc:
            _die(exc.message, exc.hint)
