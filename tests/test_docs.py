"""The guides only show commands and flags that exist, and docs/cli.md covers every command.

Walks the click tree of `gpusched` (no daemon, no subprocess): every `gpusched CMD` / `gpusched GROUP
CMD` in a fenced code block of docs/user-guide.md and docs/admin-guide.md must resolve to a command,
and every `--flag` given to it must be one of its options.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

from gpusched_cli.main import cli

DOCS = Path(__file__).resolve().parent.parent / "docs"
GUIDES = ("user-guide.md", "admin-guide.md")

# Tokens after which a word is in command position (so `gpusched` there is the client being run).
_COMMAND_START = {"|", "||", "&&", ";", "(", "$(", "`", "sudo", "exec", "time", "watch", "then", "do"}
# Tokens that end a command's arguments.
_COMMAND_END = {"|", "||", "&&", ";", ")", "`", ">", ">>", "2>", "2>&1", "<", "&"}
_PROMPT = re.compile(r"^\s*[\w.-]*\$ ")  # `$ cmd`, `alice$ cmd`
_ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_COMMAND_WORD = re.compile(r"^[a-z][a-z-]*$")


def fenced_blocks(text: str) -> list[str]:
    """The contents of every ``` fenced block (also indented ones, inside list items)."""
    return re.findall(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", text, flags=re.M | re.S)


def command_lines(block: str) -> list[str]:
    """Lines of a block with `\\` continuations joined and `$ ` prompts removed."""
    lines: list[str] = []
    pending = ""
    for raw in block.splitlines():
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        lines.append(_PROMPT.sub("", pending + raw, count=1))
        pending = ""
    if pending:
        lines.append(_PROMPT.sub("", pending, count=1))
    return lines


def tokens(line: str) -> list[str]:
    spaced = line.replace("$(", " $( ").replace("`", " ` ")
    try:
        return shlex.split(spaced, comments=True)
    except ValueError:  # output text with an apostrophe, not a command
        return spaced.split()


def invocations(line: str) -> list[list[str]]:
    """Each `gpusched ...` in command position on the line, as its argument tokens (up to a separator)."""
    toks = tokens(line)
    found: list[list[str]] = []
    for i, tok in enumerate(toks):
        if tok != "gpusched":
            continue
        before = toks[i - 1] if i else None
        if before is not None and before not in _COMMAND_START and not _ENV_ASSIGNMENT.match(before):
            continue
        args: list[str] = []
        for t in toks[i + 1:]:
            if t in _COMMAND_END:
                break
            args.append(t)
        found.append(args)
    return found


def option_names(command: click.Command) -> dict[str, bool]:
    """Every option spelling of the command -> whether it takes a value."""
    ctx = click.Context(command)
    names: dict[str, bool] = {}
    for param in command.get_params(ctx):
        if isinstance(param, click.Option):
            takes_value = not param.is_flag and not param.count
            for name in (*param.opts, *param.secondary_opts):
                names[name] = takes_value
    return names


def resolve(args: list[str]) -> tuple[list[str], click.Command, list[str]] | None:
    """(command path, command, the arguments after it), or None when the words are not a command."""
    command: click.Command = cli
    path: list[str] = []
    rest = list(args)
    top = option_names(cli)
    while rest and rest[0].startswith("-") and command is cli:  # gpusched --socket PATH CMD
        flag = rest.pop(0).split("=", 1)[0]
        assert flag in top, f"`gpusched {flag}` is not an option of gpusched"
        if top[flag] and "=" not in flag and rest:
            rest.pop(0)
    while rest and isinstance(command, click.Group) and not rest[0].startswith("-"):
        word = rest[0]
        if not _COMMAND_WORD.match(word):
            return None if command is cli else (path, command, rest)  # output such as "gpusched 0.1.0"
        sub = command.commands.get(word)
        if sub is None:
            if command is cli or not command.invoke_without_command:
                raise AssertionError(f"`gpusched {' '.join([*path, word])}` is not a gpusched command")
            break
        path.append(word)
        command = sub
        rest.pop(0)
    return (path, command, rest) if path else None


def flags_used(command: click.Command, rest: list[str]) -> list[str]:
    """The option words given to the command (not those of the program it runs, after `--`)."""
    options = option_names(command)
    interspersed = command.context_settings.get("allow_interspersed_args", True)
    used: list[str] = []
    i = 0
    while i < len(rest):
        tok = rest[i]
        if tok == "--":
            break
        if tok.startswith("-") and len(tok) > 1 and not tok.lstrip("-").isdigit():
            name = tok.split("=", 1)[0]
            used.append(name)
            if options.get(name) and "=" not in tok:
                i += 1  # its value
        elif not interspersed:
            break  # `submit`: the job's own command starts here
        i += 1
    return used


def guide_invocations() -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for guide in GUIDES:
        text = (DOCS / guide).read_text()
        for block in fenced_blocks(text):
            for line in command_lines(block):
                if "gpusched" in line:
                    out.append((guide, line))
    return out


def all_commands(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for name, command in sorted(group.commands.items()):
        out.append((*prefix, name))
        if isinstance(command, click.Group):
            out.extend(all_commands(command, (*prefix, name)))
    return out


def test_the_guides_show_commands() -> None:
    found = [args for _, line in guide_invocations() for args in invocations(line)]
    assert len(found) > 40, "the guides should be full of examples; did the parsing break?"


@pytest.mark.parametrize("guide", GUIDES)
def test_every_command_and_flag_in_the_guides_exists(guide: str) -> None:
    problems: list[str] = []
    seen: set[str] = set()
    for where, line in guide_invocations():
        if where != guide:
            continue
        for args in invocations(line):
            try:
                resolved = resolve(args)
            except AssertionError as exc:
                problems.append(f"{exc}: {line.strip()}")
                continue
            if resolved is None:
                continue
            path, command, rest = resolved
            seen.add(" ".join(path))
            valid = option_names(command)
            for flag in flags_used(command, rest):
                if flag not in valid:
                    problems.append(f"`gpusched {' '.join(path)}` has no option {flag}: {line.strip()}")
    assert not problems, "\n".join(problems)
    assert seen, f"no gpusched commands found in {guide}"


def test_every_command_is_in_the_cli_reference() -> None:
    text = (DOCS / "cli.md").read_text()
    headings = [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]
    missing = []
    for path in all_commands(cli):
        words = " ".join(path)
        mentioned = re.search(rf"\bgpusched {re.escape(words)}(?![\w-])", text) or any(
            re.search(rf"(^|[\s,(]){re.escape(words)}($|[\s,)])", h) for h in headings
        )
        if not mentioned:
            missing.append(words)
    assert not missing, f"docs/cli.md does not describe: {', '.join(missing)}"


def test_the_walker_catches_mistakes() -> None:
    """The checks above are only worth something if they can fail."""
    assert resolve(["gpus", "drain", "0", "--reason", "x"]) is not None
    with pytest.raises(AssertionError):
        resolve(["frobnicate"])
    with pytest.raises(AssertionError):
        resolve(["mig", "remove", "0"])
    path, command, rest = resolve(["submit", "--gpus", "1", "--json", "--", "python", "--lr", "3"]) or ([], cli, [])
    assert path == ["submit"] and flags_used(command, rest) == ["--gpus", "--json"]
    path, command, rest = resolve(["submit", "--mig", "1g.10gb", "python", "--epochs", "3"]) or ([], cli, [])
    assert flags_used(command, rest) == ["--mig"]
    path, command, rest = resolve(["queue", "--bogus"]) or ([], cli, [])
    assert "--bogus" not in option_names(command)
    assert invocations("journalctl -u gpusched --since today") == []
    assert invocations(command_lines("alice$ gpusched queue | head")[0]) == [["queue"]]
    assert resolve(["0.1.0", "(protocol", "1.0)"]) is None
