"""click parameters made from the declarations in options.py, so each everyday command's options are
written once and the fast path parses exactly what click would."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import click

from gpusched_cli.options import CHOICE, FLAG, INT, Command, Option, Positional, UsageProblem

F = TypeVar("F", bound=Callable[..., Any])


def _callback(convert: Callable[[Any], Any], multiple: bool) -> Callable[[click.Context, click.Parameter, Any], Any]:
    """click calls a callback for every parameter, given or not (None, or () for a repeatable one)."""

    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value is None and not multiple:
            return None
        try:
            return convert(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc), ctx, param) from None

    return callback


def click_option(option: Option) -> Callable[[F], F]:
    kwargs: dict[str, Any] = dict(option.click)
    if option.kind == FLAG:
        kwargs["is_flag"] = True
    elif option.kind == INT:
        kwargs["type"] = click.IntRange(option.low, option.high)
    elif option.kind == CHOICE:
        kwargs["type"] = click.Choice(option.choices, case_sensitive=option.case_sensitive)
    if option.default is not None and option.kind != FLAG:
        kwargs["default"] = option.default
    if option.multiple:
        kwargs["multiple"] = True
    if option.convert is not None:
        kwargs["callback"] = _callback(option.convert, option.multiple)
    return click.option(*option.flags, option.dest, **kwargs)


def click_argument(positional: Positional) -> Callable[[F], F]:
    kwargs: dict[str, Any] = {"required": positional.required}
    if positional.how == "rest":
        kwargs.update(nargs=-1, type=click.UNPROCESSED)
    elif positional.how == "many":
        kwargs["nargs"] = -1
    convert = positional.convert
    if convert is not None:
        one = _callback(convert, multiple=False)
        kwargs["callback"] = (one if positional.how == "one" else
                              lambda ctx, param, values: [one(ctx, param, value) for value in values])
    return click.argument(positional.dest, metavar=positional.metavar, **kwargs)


def declared(command: Command) -> Callable[[F], F]:
    """Decorate a click command function with `command`'s options, in their order, then its argument."""

    def decorate(function: F) -> F:
        if command.positional is not None:
            function = click_argument(command.positional)(function)
        for option in reversed(command.options):
            function = click_option(option)(function)
        return function

    return decorate


@contextmanager
def usage_problems() -> Iterator[None]:
    """A UsageProblem as click's usage error: exit 2 with the command's usage line."""
    try:
        yield
    except UsageProblem as exc:
        if exc.param_hint is None:
            raise click.UsageError(exc.message) from None
        raise click.BadParameter(exc.message, param_hint=exc.param_hint) from None
