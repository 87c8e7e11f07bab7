"""`gpusched replay`: a trace through the scheduler on simulated GPUs, in this process (no daemon)."""

from __future__ import annotations

import json

import click

from gpusched_cli.common import echo
from gpusched_cli.exits import EXIT_ERROR, EXIT_USAGE


@click.command()
@click.argument("trace", type=click.Path(exists=True, dir_okay=False))
@click.option("--format", "fmt", type=click.Choice(["auto", "csv", "alibaba"]), default="auto", show_default=True,
              help="trace format; auto looks at the header")
@click.option("--gpus", default="H100-80GB:8", show_default=True, metavar="MODEL:COUNT[,...]",
              help="simulated node, as gpuschedd --sim; models: A100-40GB, A100-80GB, H100-80GB, H100-PCIe, "
              "H100-NVL, H200, GH200-96GB, GH200-144GB (NVIDIA); MI300X, MI325X (AMD Instinct, in SPX/NPS1: one "
              "logical GPU each); one vendor per node")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="replay TOML: [fairness] [scheduler] [mig] [replay] [interference] (docs/replay.md)")
@click.option("--policy", default="all", show_default=True,
              help="comma-separated: gpusched, fifo-whole, fifo-timeslice, static-mig, all (the four), or a "
              "plug-in as package.module:Class (docs/policies.md)")
@click.option("--load", type=float, default=None, help="scale arrivals to this offered load (alibaba default 0.9)")
@click.option("--users", type=click.IntRange(1, 100000), default=16, show_default=True,
              help="alibaba: pods are spread over this many users (hash of name and seed)")
@click.option("--seed", type=int, default=1, show_default=True,
              help="alibaba: seed of the user assignment (and of the --times-from draw)")
@click.option("--times-from", "times_from", type=click.Path(exists=True, dir_okay=False), default=None,
              help="for an alibaba pod list without time columns (multigpu50): take arrival and run times "
                   "from FILE (e.g. openb_pod_list_default.csv), by pod name, else from a pod drawn by hash")
@click.option("--censored", type=click.Choice(["keep", "drop"]), default="keep", show_default=True,
              help="alibaba: pods still running when the trace was taken (deletion_time = the file's last; "
                   "their duration is only a lower bound): replay them as jobs, or leave them out before "
                   "arrivals are scaled to --load")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per policy, one per line (docs/replay.md)")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="write a PNG: utilization over time and service per user")
@click.pass_context
def replay(ctx: click.Context, trace: str, fmt: str, gpus: str, config_path: str | None, policy: str,
           load: float | None, users: int, seed: int, times_from: str | None, censored: str, as_json: bool,
           plot_path: str | None) -> None:
    """Replay a job trace through the scheduler on simulated GPUs under a virtual clock (no daemon).

    Runs each policy on the same trace and prints their figures side by side. Exits 2 on a bad
    trace, config or option.
    """
    if plot_path is not None and not plot_path.strip():
        raise click.BadParameter("is empty; give the PNG file to write", param_hint="--plot")
    from gpusched.replay import runner  # heavy (core, simulator): only when this command runs
    from gpusched.replay.policies import ReplayConfigError
    from gpusched.replay.trace import TraceError

    try:
        report = runner.run_replay(trace, gpus=gpus, fmt=fmt, config_path=config_path,
                                   policies=runner.resolve_policies(policy), load=load, users=users, seed=seed,
                                   times_from=times_from, censored="drop" if censored == "drop" else "keep",
                                   freeze_trace=True)  # this process only replays (gcpause.py)
    except TraceError as exc:
        echo(f"gpusched: bad trace:\n{exc}", err=True)
        ctx.exit(EXIT_USAGE)
    except (ReplayConfigError, ValueError) as exc:
        echo(f"gpusched: {exc}", err=True)
        ctx.exit(EXIT_USAGE)
    except OSError as exc:
        echo(f"gpusched: {exc.filename or trace}: {exc.strerror}", err=True)
        ctx.exit(EXIT_USAGE)
    if as_json:
        for summary in report.summaries:
            echo(json.dumps(summary))
        for skipped in report.skipped:  # (stdout keeps one summary per line)
            echo(f"gpusched: {skipped.policy} skipped: {skipped.reason}", err=True)
    else:
        echo(runner.render_table(report))
    if plot_path is not None:
        from gpusched.replay.plot import PlotUnavailable, write_plot

        try:
            write_plot(report, plot_path)
        except PlotUnavailable as exc:
            echo(f"gpusched: {exc}", err=True)
            ctx.exit(EXIT_ERROR)
        except OSError as exc:
            echo(f"gpusched: cannot write the plot to {plot_path}: {exc.strerror or exc}", err=True)
            ctx.exit(EXIT_ERROR)
        if not as_json:
            echo(f"plot written to {plot_path}")
