"""`gpusched` as a click program. One click command per protocol request, same names.

The console script enters fastpath.py, which runs a plain job command line without click and hands
every other one here untouched. This module is the root group only: the `--socket` and `--version`
options, the mapping of every failure to one documented exit code (common.report_failure, exits.py,
docs/cli.md), and `COMMANDS`, the one table of which module holds which command. A command's module
is imported when that command runs (or when `--help` lists them all), so `gpusched gpus` loads
click, the socket client and the gpus command, and nothing else: no pydantic, no protocol models, no
scheduler, NVML or asyncio. Requests go out as plain JSON (`messages.py`) and results are read as
plain JSON (`results.py`).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import click

from gpusched.wire import PROTOCOL_VERSION
from gpusched_cli.common import Target, report_failure

# The exit codes lived here before exits.py; re-exported for the tests and scripts that import them.
from gpusched_cli.exits import CODE_EXITS as CODE_EXITS
from gpusched_cli.exits import EXIT_CODES_HELP as EXIT_CODES_HELP
from gpusched_cli.exits import EXIT_ERROR as EXIT_ERROR
from gpusched_cli.exits import EXIT_INTERRUPTED as EXIT_INTERRUPTED
from gpusched_cli.exits import EXIT_JOB_CANCELLED as EXIT_JOB_CANCELLED
from gpusched_cli.exits import EXIT_JOB_LOST as EXIT_JOB_LOST
from gpusched_cli.exits import EXIT_JOB_NOT_RUN as EXIT_JOB_NOT_RUN
from gpusched_cli.exits import EXIT_JOB_TIMEOUT as EXIT_JOB_TIMEOUT
from gpusched_cli.exits import EXIT_LIMIT as EXIT_LIMIT
from gpusched_cli.exits import EXIT_NOT_FOUND as EXIT_NOT_FOUND
from gpusched_cli.exits import EXIT_OK as EXIT_OK
from gpusched_cli.exits import EXIT_OUTPUT_CLOSED as EXIT_OUTPUT_CLOSED
from gpusched_cli.exits import EXIT_PERMISSION as EXIT_PERMISSION
from gpusched_cli.exits import EXIT_UNAVAILABLE as EXIT_UNAVAILABLE
from gpusched_cli.exits import EXIT_UNSATISFIABLE as EXIT_UNSATISFIABLE
from gpusched_cli.exits import EXIT_USAGE as EXIT_USAGE
from gpusched_cli.exits import EXIT_VERSION as EXIT_VERSION
from gpusched_cli.exits import job_exit_status as job_exit_status

# Every command (or command group) by name -> "module:attribute" under gpusched_cli.commands.
# THE place to add one: write the click command in its module, add its line here (and to docs/cli.md).
COMMANDS: dict[str, str] = {
    "submit": "submit:submit",
    "queue": "jobs:queue",
    "show": "jobs:show",
    "logs": "jobs:logs",
    "wait": "jobs:wait",
    "cancel": "jobs:cancel",
    "suspend": "jobs:suspend",
    "resume": "jobs:resume",
    "hold": "jobs:hold",
    "release": "jobs:release",
    "gpus": "devices:gpus",
    "mig": "devices:mig",
    "sim": "devices:sim",
    "top": "node:top",
    "stats": "node:stats",
    "doctor": "node:doctor",
    "admin": "node:admin",
    "shutdown": "node:shutdown",
    "replay": "replay:replay",
    "slurm": "slurm:slurm",
}


class LazyCommands(MutableMapping[str, click.Command]):
    """The root group's commands, each imported from its module on first use.

    click reads a group's commands through this mapping (`get_command`, `list_commands`), so a run
    of `gpusched queue` imports only the module that holds `queue`.
    """

    def __init__(self, where: Mapping[str, str]) -> None:
        self._where = dict(where)
        self._loaded: dict[str, click.Command] = {}

    def __getitem__(self, name: str) -> click.Command:
        if name not in self._loaded:
            module, _, attr = self._where[name].partition(":")  # KeyError: no such command
            command: click.Command = getattr(importlib.import_module(f"gpusched_cli.commands.{module}"), attr)
            self._loaded[name] = command
        return self._loaded[name]

    def __setitem__(self, name: str, command: click.Command) -> None:
        self._where.setdefault(name, "")
        self._loaded[name] = command

    def __delitem__(self, name: str) -> None:
        del self._where[name]
        self._loaded.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


class _Cli(click.Group):
    """Maps every failure of a command to its exit code and an `error:`/`hint:` pair on stderr."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except Exception as exc:
            report_failure(exc, ctx.obj if isinstance(ctx.obj, Target) else None)
            raise


@click.group(
    cls=_Cli,
    commands=LazyCommands(COMMANDS),
    epilog=EXIT_CODES_HELP,
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.option(
    "--socket",
    "socket_path",
    metavar="PATH",
    help="daemon socket (default: $GPUSCHED_SOCKET, else the system or your own daemon's socket)",
)
@click.version_option(
    package_name="gpusched",
    prog_name="gpusched",
    message=f"%(prog)s %(version)s (protocol {PROTOCOL_VERSION})",
)
@click.pass_context
def cli(ctx: click.Context, socket_path: str | None) -> None:
    """Submit GPU jobs to gpuschedd and watch them: whole GPUs, MIG instances or MPS shares."""
    ctx.obj = Target(socket_path)


def main() -> None:
    """Entry for `python -m gpusched_cli.main` with the program named as users know it."""
    cli(prog_name="gpusched")


if __name__ == "__main__":
    main()
