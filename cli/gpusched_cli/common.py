"""What every command module shares: a connected client, and printing that is safe on a terminal."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import click

from gpusched.arrayspec import ArraySpecError, parse_job_ref
from gpusched_cli import render, resubmit
from gpusched_cli.client import Client, resolve_socket


class OutputClosed(Exception):
    """Standard output cannot be written: the reader of a pipe went away (`gpusched queue | head -1`),
    or a full disk. Not the daemon's connection, which the same errno would otherwise be taken for."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error.strerror or str(error))
        self.error = error


@contextmanager
def writing_output() -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        raise OutputClosed(exc) from None


def echo(message: str, err: bool = False) -> None:
    """Print for people: every character a terminal would act on is escaped (render.printable), since
    names, commands, reasons and even error messages can carry other users' text."""
    if err:
        with contextlib.suppress(OSError):  # nothing better to do with an error that cannot be shown
            click.echo(render.printable(message), err=True)
        return
    with writing_output():
        click.echo(render.printable(message))


def fail(message: str, hint: str, code: int) -> NoReturn:
    echo(f"error: {message}", err=True)
    if hint:
        echo(f"hint: {hint}", err=True)
    sys.exit(code)


@contextmanager
def connected(ctx: click.Context, timeout: float = 60.0, retry_broken_s: float = 0.0) -> Iterator[Client]:
    """A connected client on the socket chosen by --socket / $GPUSCHED_SOCKET / discovery.

    `retry_broken_s`: a connection that a daemon accepted and then broke (killed or restarted during
    the hello) is tried again for this long (`submit`); a daemon that is simply not there is not."""
    obj = ctx.find_root().obj
    path = resolve_socket(obj.get("socket"))
    obj["socket_path"] = path
    client = Client(path, timeout=timeout)
    try:
        try:
            client.connect()  # not `with Client(...)`: a refused hello would leave the socket open
        except (ConnectionError, TimeoutError):
            if retry_broken_s <= 0:
                raise
            resubmit.reconnect(client, time.monotonic() + retry_broken_s)
        yield client
    finally:
        client.close()


def print_json(data: Any, compact: bool = False) -> None:
    """The daemon's result as it sent it (the documented `--json` shape), or a dict of our own."""
    echo(json.dumps(data, separators=(",", ":")) if compact else json.dumps(data, indent=2))


def write_verbatim(text: str) -> None:
    """Log text exactly as the job wrote it: no ANSI stripping (click.echo would), no re-encoding."""
    with writing_output():
        sys.stdout.flush()
        sys.stdout.buffer.write(text.encode("utf-8", "surrogateescape"))
        sys.stdout.buffer.flush()



JobRef = tuple[int, int | None]  # (job or array id, task index or None)


def _one_ref(ctx: click.Context, param: click.Parameter, value: str) -> JobRef:
    """ID or ARRAY_TASK (`123_7`) -> (id, task or None); a bad one exits 2 naming the argument."""
    try:
        return parse_job_ref(value)
    except ArraySpecError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


def _many_refs(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> list[JobRef]:
    return [_one_ref(ctx, param, text) for text in value]


# The job arguments of show / logs / wait (one) and cancel / suspend / resume / hold / release (many):
# a job id (an array's id: all its tasks), or an array task as `123_7`.
REF = click.argument("ref", callback=_one_ref, metavar="ID|ARRAY_TASK")
REFS = click.argument("refs", nargs=-1, required=True, callback=_many_refs, metavar="ID|ARRAY_TASK...")
