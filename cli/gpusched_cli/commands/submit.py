"""`gpusched submit` as a click command: SUBMIT's options (run_submit.py, where the command's work
is done, shared with the fast path) and its help."""

from __future__ import annotations

from typing import Any

import click

from gpusched_cli.commands.declared import declared, usage_problems
from gpusched_cli.common import target_of
from gpusched_cli.run_submit import SUBMIT, build_request, prepare, send

__all__ = ["build_request", "submit"]


@click.command(context_settings={"allow_interspersed_args": SUBMIT.interspersed})
@declared(SUBMIT)
@click.pass_context
def submit(ctx: click.Context, /, **values: Any) -> None:
    """Queue CMD (run without a shell, in this directory, with this environment).

    \b
    Examples:
      gpusched submit --gpus 2 --time 4:00:00 -- python train.py --lr 3e-4
      gpusched submit --mig 3g.40gb --name eval -- ./eval.sh
      gpusched submit --share 0.25 --gpu-mem 10G --wait -- python infer.py
      gpusched submit --partition cpx -- python small.py   # AMD: one eighth of an MI300X
      gpusched submit --gpus 1 --array 0-99%8 -- python sweep.py   # task i reads $GPUSCHED_ARRAY_TASK_ID
    """
    with usage_problems():
        job = prepare(**values)
    send(target_of(ctx), job)
