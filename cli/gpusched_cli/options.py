"""A command's options declared once, as data: click builds its options from them, and the fast
path (fastpath.py) parses the same declarations without importing click.

Importing click costs `gpusched submit` more than the interpreter's own start (issue 13), so the
everyday commands parse their argv here first. This parser is strict, not clever: it accepts only
the plain forms (`--flag`, `--opt VALUE`, `--opt=VALUE`, values that do not start with `-`, each
single-valued option once, values its converter takes) and answers None for anything else: a help
flag, an unknown or repeated option, a bad value. Then the caller runs click, which says exactly
what is wrong, as it always did. Where this parser answers, it answers what click would
(tests/cli/test_fastpath.py holds the two to each other over generated command lines).

Standard library only, and nothing beyond it: this module is on the fast path.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing costs the fast path a few ms to import; mypy reads this as True
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import Any

    Convert = Callable[[Any], Any]

FLAG, INT, CHOICE, TEXT = "flag", "int", "choice", "text"


class UsageProblem(Exception):
    """A command line that cannot run, found after parsing (flags that do not go together, a value the
    environment makes impossible). click shows it as a usage error naming `param_hint`; the fast
    path hands the command line to click, which raises it again."""

    def __init__(self, message: str, param_hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param_hint = param_hint


class Option:
    """One option: its flags, where its value goes, its kind, and what click shows for it.

    `convert` (for TEXT, or a `multiple` option's tuple of values) raises ValueError with a message
    that click prints after `Invalid value for '--flag':`. `low`/`high` bound an INT, `choices` a
    CHOICE. `click` holds the options' remaining click arguments (help, metavar, show_default).
    """

    __slots__ = ("case_sensitive", "choices", "click", "convert", "default", "dest", "flags", "high", "kind", "low",
                 "multiple")

    def __init__(self, *flags: str, dest: str, kind: str = TEXT, default: Any = None, convert: Convert | None = None,
                 low: int = 0, high: int = 0, choices: Sequence[str] = (), case_sensitive: bool = True,
                 multiple: bool = False, **click: Any) -> None:
        self.flags = flags
        self.dest = dest
        self.kind = kind
        self.default = False if kind == FLAG else default
        self.convert = convert
        self.low, self.high = low, high
        self.choices = tuple(choices)
        self.case_sensitive = case_sensitive
        self.multiple = multiple
        self.click = click

    def value(self, given: Any) -> Any:
        """The option's value from what the command line gave (None: not given); raises ValueError
        where click would refuse it, or where this parser leaves the judgement to click."""
        if given is None:
            if self.multiple:
                return self.convert(()) if self.convert is not None else ()
            return self.default
        if self.kind == FLAG:
            return True
        if self.multiple:
            return self.convert(tuple(given)) if self.convert is not None else tuple(given)
        if self.kind == INT:
            # ASCII digits only: click's int() also takes `+3`, ` 3` and `3_0`, which click may judge
            if not (given.isascii() and given.isdigit()) or not self.low <= int(given) <= self.high:
                raise ValueError(given)
            return int(given)
        if self.kind == CHOICE:
            if given not in self.choices:  # click matches case-insensitive choices too: its call
                raise ValueError(given)
            return given
        return self.convert(given) if self.convert is not None else given


class Positional:
    """A command's arguments after its options: `rest` (everything after the options, verbatim, as
    `nargs=-1` with `--`), or `many`/`one` values of `convert`; `metavar` is what click's usage shows."""

    __slots__ = ("convert", "dest", "how", "metavar", "required")

    def __init__(self, dest: str, how: str, convert: Convert | None = None, required: bool = True,
                 metavar: str | None = None) -> None:
        self.dest = dest
        self.metavar = metavar
        self.how = how  # "rest", "many" or "one"
        self.convert = convert
        self.required = required


class Command:
    """A command's options and arguments, as both parsers read them. `interspersed`: may options
    follow arguments (click's allow_interspersed_args; `submit` says no, so CMD keeps its own flags)."""

    __slots__ = ("by_flag", "interspersed", "options", "positional")

    def __init__(self, options: Sequence[Option], positional: Positional | None = None,
                 interspersed: bool = True) -> None:
        self.options = tuple(options)
        self.positional = positional
        self.interspersed = interspersed
        self.by_flag = {flag: option for option in self.options for flag in option.flags}

    def parse(self, argv: Sequence[str]) -> dict[str, Any] | None:
        """The values click would pass the command for `argv` (what follows the command's name), or
        None when this parser leaves `argv` to click (see the module docstring)."""
        given: dict[str, Any] = {}
        args: list[str] = []
        i = 0
        while i < len(argv):
            arg = argv[i]
            i += 1
            if arg == "--":
                if self.positional is None or self.positional.how != "rest":
                    return None  # rare outside submit; click knows its rules
                args.extend(argv[i:])
                break
            if arg[:1] != "-" or arg == "-":
                if not self.interspersed:
                    args.extend(argv[i - 1:])
                    break
                args.append(arg)
                continue
            name, eq, inline = arg.partition("=") if arg.startswith("--") else (arg, "", "")
            option = self.by_flag.get(name)
            if option is None:
                return None  # unknown, a help flag, or a cluster of short flags
            if option.kind == FLAG:
                if eq:
                    return None
                given[option.dest] = True
                continue
            if eq:
                value = inline
            elif i < len(argv) and argv[i][:1] != "-":
                value = argv[i]
                i += 1
            else:
                return None  # missing, or a value that looks like an option: click's call
            if option.multiple:
                given.setdefault(option.dest, []).append(value)
            elif option.dest in given:
                return None  # click takes the last; a repeat is usually a mistake worth its full path
            else:
                given[option.dest] = value
        try:
            values = {option.dest: option.value(given.get(option.dest)) for option in self.options}
            if self.positional is not None:
                values[self.positional.dest] = self._arguments(args)
            elif args:
                return None
        except ValueError:
            return None
        return values

    def _arguments(self, args: list[str]) -> Any:
        positional = self.positional
        assert positional is not None
        if positional.required and not args:
            raise ValueError("missing")
        convert = positional.convert or (lambda text: text)
        if positional.how == "rest":
            return tuple(args)
        if positional.how == "many":
            return [convert(arg) for arg in args]
        if len(args) != 1:
            raise ValueError("one argument")
        return convert(args[0])
