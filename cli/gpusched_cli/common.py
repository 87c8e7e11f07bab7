"""What every command shares: the daemon it talks to, a connected client, printing that is safe on a
terminal, and the mapping of each failure to its exit code. No click here: the fast path
(fastpath.py) runs the everyday commands through this module without importing click."""

from __future__ import annotations

import codecs
import contextlib
import errno
import json
import os
import sys
import time
from contextlib import contextmanager

from gpusched.wire import ProtocolError
from gpusched_cli import resubmit
from gpusched_cli.client import Client, ConnectionClosed, DaemonUnavailable, resolve_socket
from gpusched_cli.exits import CODE_EXITS, EXIT_ERROR, EXIT_OUTPUT_CLOSED, EXIT_UNAVAILABLE
from gpusched_cli.textfmt import printable

TYPE_CHECKING = False  # typing costs the fast path a few ms to import; mypy reads this as True
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Any, NoReturn, Protocol

    class _HasRoot(Protocol):  # a click.Context, whose root's obj is the Target
        def find_root(self) -> Any: ...


class Target:
    """The daemon a run of `gpusched` talks to: `--socket` as given (None: $GPUSCHED_SOCKET or
    discovery) and, once connected, the path chosen, which a lost connection's message names."""

    __slots__ = ("option", "path")

    def __init__(self, option: str | None) -> None:
        self.option = option
        self.path: str | None = None


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


def _is_ascii(encoding: str) -> bool:
    try:
        return codecs.lookup(encoding).name == "ascii"
    except LookupError:
        return False


def _write_line(stream: Any, text: str) -> None:
    """`text` and a newline, flushed, as click.echo writes them: a stream misconfigured as ASCII (a
    bare C locale with UTF-8 mode off) gets UTF-8 with replacement characters instead of an error."""
    if _is_ascii(getattr(stream, "encoding", None) or "ascii"):
        stream.flush()
        stream.buffer.write((text + "\n").encode("utf-8", "replace"))
        stream.buffer.flush()
        return
    stream.write(text + "\n")
    stream.flush()


def echo(message: str, err: bool = False) -> None:
    """Print for people: every character a terminal would act on is escaped (textfmt.printable), since
    names, commands, reasons and even error messages can carry other users' text."""
    if err:
        with contextlib.suppress(OSError):  # nothing better to do with an error that cannot be shown
            _write_line(sys.stderr, printable(message))
        return
    with writing_output():
        _write_line(sys.stdout, printable(message))


def fail(message: str, hint: str, code: int) -> NoReturn:
    echo(f"error: {message}", err=True)
    if hint:
        echo(f"hint: {hint}", err=True)
    sys.exit(code)


def report_failure(exc: BaseException, target: Target | None) -> None:
    """Exit with the code and `error:`/`hint:` lines for a failure every command can meet (the
    daemon absent, refusing, or gone; stdout closed); return for any other exception, which the
    caller re-raises."""
    if isinstance(exc, DaemonUnavailable):
        fail(exc.message, exc.hint, EXIT_UNAVAILABLE)
    if isinstance(exc, ProtocolError):
        fail(exc.message, exc.hint, CODE_EXITS.get(exc.code, EXIT_ERROR))
    if isinstance(exc, OutputClosed):
        # Nothing more can go to stdout: point it at /dev/null so that the interpreter's own flush at
        # exit does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        if exc.error.errno == errno.EPIPE:
            sys.exit(EXIT_OUTPUT_CLOSED)  # quietly, as a C tool that SIGPIPE ends
        fail(f"cannot write the output: {exc}", "", EXIT_ERROR)
    if isinstance(exc, (TimeoutError, ConnectionError)):
        path = "the daemon socket" if target is None or target.path is None else target.path
        fail(
            f"lost the connection to gpuschedd on {path}: {exc}",
            "the daemon may be overloaded or restarting; try again",
            EXIT_UNAVAILABLE,
        )


def target_of(where: Target | _HasRoot) -> Target:
    """The run's Target: given, or the one the root click command keeps in its context's obj."""
    if isinstance(where, Target):
        return where
    target = where.find_root().obj
    assert isinstance(target, Target), "the root command sets ctx.obj to the run's Target"
    return target


@contextmanager
def connected(where: Target | _HasRoot, timeout: float = 60.0, retry_broken_s: float = 0.0,
              resumed: bool = False) -> Iterator[Client]:
    """A connected client on the socket chosen by --socket / $GPUSCHED_SOCKET / discovery (`where`:
    the run's Target, or a click context).

    `retry_broken_s`: a connection that a daemon accepted and then broke (killed or restarted during
    the hello) is tried again for this long (`submit`); a daemon that is simply not there is not,
    unless `resumed`: the C front reached a daemon on this socket and handed the submit over (its
    connection broke, or the answer was not the plain one), so a missing socket is that daemon
    restarting, not one that was never there."""
    target = target_of(where)
    path = resolve_socket(target.option)
    target.path = path
    client = Client(path, timeout=timeout)
    retried: tuple[type[Exception], ...] = (
        (DaemonUnavailable, ConnectionError, TimeoutError) if resumed
        else (ConnectionClosed, ConnectionError, TimeoutError))
    try:
        try:
            client.connect()  # not `with Client(...)`: a refused hello would leave the socket open
        except retried:
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
