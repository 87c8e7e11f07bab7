"""The node and the daemon as a whole: top, stats, doctor, admin reload, shutdown."""

from __future__ import annotations

import sys

import click

from gpusched_cli import messages, render
from gpusched_cli.common import connected, echo, print_json
from gpusched_cli.exits import EXIT_ERROR
from gpusched_cli.parse import parse_duration_s
from gpusched_cli.results import reading

MAX_STATS_WINDOW_S = 366 * 86400  # StatsRequest.since_s's bound in the protocol (the CLI does not import it)


@click.command()
@click.option("--once", is_flag=True, help="print one snapshot and exit (for scripts)")
@click.option("--width", type=click.IntRange(40, 1000), default=120, show_default=True,
              help="line width for --once")
@click.pass_context
def top(ctx: click.Context, once: bool, width: int) -> None:
    """Live view: GPUs and their MIG slices, running jobs, the queue by user, recent events.

    Keys: q quit, s cycle sort (id, user, runtime, memory), u filter by user, p pause.
    The daemon pushes a new picture whenever something changes.
    """
    from gpusched_cli import top as top_view  # curses and the protocol's models are only needed here

    if not once and not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise click.UsageError("the live view needs a terminal; `gpusched top --once` prints one snapshot")
    with connected(ctx, timeout=30.0) as client:
        if once:
            snapshot = top_view.first_snapshot(client)
            echo("\n".join(top_view.render_top(snapshot, top_view.View(), width=width)))
            return
        top_view.run_live(client)


@click.command()
@click.option("--since", "since", default="1h", show_default=True, metavar="TIME",
              help="window length: 30m, 1h, 2d, or Slurm's forms (90 = 90 minutes)")
@click.option("--json", "as_json", is_flag=True, help="print the daemon's StatsResult (see docs/cli.md)")
@click.pass_context
def stats(ctx: click.Context, since: str, as_json: bool) -> None:
    """Per-user service, share vs entitled share, waits; Jain's fairness index; device use."""
    try:
        window = parse_duration_s(since)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--since") from None
    if window > MAX_STATS_WINDOW_S:  # the daemon's bound (protocol StatsRequest.since_s), said in the flag's terms
        raise click.BadParameter(f"{since!r} is longer than the 366 days the daemon can report on",
                                 param_hint="--since")
    with connected(ctx) as client:
        result = client.request(messages.stats(window))
    if as_json:
        print_json(result)
        return
    with reading("stats", result):
        text = render.stats_text(result)
    echo(text)


@click.command()
@click.option("--json", "as_json", is_flag=True, help='print {"checks": [{name, status, detail, hint}]}')
@click.pass_context
def doctor(ctx: click.Context, as_json: bool) -> None:
    """Check the node as an admin would: driver, MIG modes, foreign CUDA processes, cgroups, permissions.

    Exits 1 when any check FAILs (WARNs alone exit 0).
    """
    with connected(ctx) as client:
        result = client.request(messages.bare("doctor"))
    with reading("doctor", result):
        failed = any(c["status"] == "FAIL" for c in result["checks"])
        if as_json:
            print_json(result)
        else:
            echo(render.doctor_text(result))
    if failed:
        ctx.exit(EXIT_ERROR)


@click.group()
def admin() -> None:
    """Administration of the daemon itself."""


@admin.command("reload")
@click.pass_context
def admin_reload(ctx: click.Context) -> None:
    """Re-read the daemon's config file (like `systemctl reload gpusched`).

    Weights and quanta apply at once and nobody loses their place in the queue; settings bound to
    resources (socket, state_dir, sim, cgroup_root, metrics address) need a restart and are listed.
    A bad file is refused with the reason and the daemon keeps its previous configuration. A MIG
    layout that a busy GPU keeps back is listed as not applied yet; it is applied once the GPU is free.
    """
    with connected(ctx) as client:
        result = client.request(messages.bare("reload"))
    with reading("reload", result):
        changed, restart_needed = list(result["changed"]), list(result["restart_needed"])
        not_applied = [str(line) for line in result.get("not_applied", [])]
    echo("reloaded: " + (", ".join(changed) if changed else "no changes"))
    if restart_needed:
        echo("needs a restart to take effect: " + ", ".join(restart_needed))
    for line in not_applied:
        echo(f"not applied yet: {line}")


@click.command()
@click.pass_context
def shutdown(ctx: click.Context) -> None:
    """Ask the daemon to stop (admin only). Running jobs are handled by its shutdown policy."""
    with connected(ctx) as client:
        result = client.request(messages.bare("shutdown"))
    with reading("shutdown", result):
        stopping = bool(result["stopping"])
    echo("gpuschedd is stopping" if stopping else "gpuschedd did not agree to stop")
