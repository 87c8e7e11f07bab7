"""The fast path (fastpath.py, options.py) parses exactly what click parses, or leaves it to click.

Property: for any command line made of a fast command's flags, odd values and stray tokens, the fast
parser either declines (None) or gives the very values click passes the command. Then: it does not
decline the ordinary command lines (or it would be slow for nothing), it declines help, completion
and anything it cannot judge, and the program run both ways prints the same bytes with the same
exit status against a real daemon.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import click
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpusched_cli import fastpath, run_jobs
from gpusched_cli.commands.jobs import cancel, logs, queue, show, wait
from gpusched_cli.commands.submit import submit
from gpusched_cli.options import CHOICE, FLAG, INT, Command, Option
from gpusched_cli.run_submit import SUBMIT
from tests.conftest import DaemonHandle

FAST: dict[str, tuple[Command, click.Command]] = {
    "submit": (SUBMIT, submit), "queue": (run_jobs.QUEUE, queue), "show": (run_jobs.SHOW, show),
    "logs": (run_jobs.LOGS, logs), "wait": (run_jobs.WAIT, wait), "cancel": (run_jobs.REFS_ONLY, cancel),
}

# Values on the edges of what click and the converters take, by option (its dest), and stray tokens.
EDGES: dict[str, list[str]] = {
    "gpu_mem": ["10G", "512M", "1.5GiB", "1024", "0", "lots", " 2g "], "mem": ["32G", "0", "1e3", "7t"],
    "time_limit": ["1h30m", "90", "400d", "1:00:00", "0", "xx", "2-00:00:00"],
    "share": ["0.25", "25%", "0.001", "1", "2", "abc", " 0.5 "],
    "after": ["12", "12,13:any", "120_7", "x", "0", "99999999999999999999"],
    "array": ["1-3%2", "5-1", "0-99:10", "7", "", "1,,2"], "mig": ["1g.10gb", "3g.40gb+me", "bad", "1G.10GB"],
    "name": ["n", "", "a b", "\u00e9"], "user": ["alice", "", "root"], "export": ["ALL", "NONE", "NONE,X=1", "=x", ""],
}
JUNK = ["1", "0", "+3", " 3", "3_0", "\u0663", "", "-1", "-", "--", "abc", "1_2", "1_", "_1", "x", "--bogus", "-h",
        "--help"]


def _values(option: Option) -> list[str]:
    if option.kind == INT:
        return [str(option.low), str(option.high), str(option.high + 1), "0", "007", "+3", " 3", "x"]
    if option.kind == CHOICE:
        return [*option.choices, option.choices[0].upper(), "x"]
    return EDGES.get(option.dest, ["v"])


def _click_values(command: click.Command, args: list[str]) -> dict[str, Any] | None:
    """What click passes the command for `args`, or None where click refuses them or shows help."""
    try:
        with command.make_context(command.name or "cmd", list(args)) as ctx:
            return dict(ctx.params)
    except (click.exceptions.ClickException, click.exceptions.Exit):
        return None


@st.composite
def command_lines(draw: st.DrawFn) -> tuple[str, list[str]]:
    """Mostly command lines click takes (flags with values of their own kind), with edges and junk."""
    name = draw(st.sampled_from(sorted(FAST)))
    declaration, _ = FAST[name]
    args: list[str] = []
    for _ in range(draw(st.integers(0, 6))):
        option = draw(st.sampled_from(declaration.options)) if declaration.options else None
        how = draw(st.integers(0, 9))
        if option is None or how == 0:
            args.append(draw(st.sampled_from(JUNK)))
        elif option.kind == FLAG:
            args.append(draw(st.sampled_from(option.flags)))
        else:
            flag, value = draw(st.sampled_from(option.flags)), draw(st.sampled_from(_values(option)))
            args += [f"{flag}={value}"] if how == 1 else [flag, value]
    refs = st.sampled_from(["1", "12", "3_4", "x", "1_", "0"])
    if name == "submit":
        tail = draw(st.lists(st.sampled_from(["true", "--x", "-", "", "a b"]), min_size=draw(st.integers(0, 1)),
                             max_size=3))
        args += ["--", *tail] if draw(st.booleans()) else tail
    elif name in ("show", "logs", "wait"):
        args.insert(draw(st.integers(0, len(args))), draw(refs)) if draw(st.integers(0, 5)) else None
    elif name == "cancel":
        args += draw(st.lists(refs, max_size=3))
    return name, args


@settings(max_examples=1500, deadline=None)
@given(command_lines())
def test_the_fast_parser_gives_what_click_gives_or_declines(line: tuple[str, list[str]]) -> None:
    name, args = line
    declaration, command = FAST[name]
    mine = declaration.parse(args)
    if mine is not None:
        assert mine == _click_values(command, args), (name, args)


ORDINARY = [
    ("submit", ["--gpus", "2", "--time", "4:00:00", "--", "python", "train.py", "--lr", "3e-4"]),
    ("submit", ["--mig", "3g.40gb", "--name", "eval", "--", "./eval.sh"]),
    ("submit", ["--share", "0.25", "--gpu-mem", "10G", "--wait", "--", "python", "infer.py"]),
    ("submit", ["--partition", "cpx", "--", "python", "small.py"]),
    ("submit", ["--gpus", "1", "--array", "0-99%8", "--", "python", "sweep.py"]),
    ("submit", ["--gpus=1", "--class", "interactive", "--nice", "5", "--after", "12:any", "--after", "120_7",
                "--requeue", "--hold", "--cpus", "4", "--mem", "32G", "--export", "NONE,X=1", "--precision", "bf16",
                "--json", "sleep", "60"]),
    ("queue", []), ("queue", ["--all", "--user", "alice", "--order", "fairness", "--limit", "20", "--json"]),
    ("queue", ["--array-tasks"]), ("show", ["12"]), ("show", ["12_3", "--json"]), ("logs", ["-f", "4"]),
    ("wait", ["--json", "4"]), ("cancel", ["1", "2", "3_4"]),
]


@pytest.mark.parametrize(("name", "args"), ORDINARY)
def test_ordinary_command_lines_take_the_fast_path(name: str, args: list[str]) -> None:
    declaration, command = FAST[name]
    mine = declaration.parse(args)
    assert mine is not None, args
    assert mine == _click_values(command, args)


@pytest.mark.parametrize("argv", [
    ["--help"], ["--version"], ["-h"], [], ["gpus"], ["stats"], ["replay", "x"],  # not fast commands
    ["submit", "--help"], ["queue", "-h"], ["show", "--json", "--help", "1"],
    ["--socket"], ["--socket", "--help", "queue"], ["--socket", "a", "--socket", "b", "queue"],
    ["--sock", "a", "queue"],
    ["submit", "--gpus", "1", "--gpus", "2", "--", "true"],  # a repeat: click takes the last; so does its message
    ["submit", "--gpus", "-1", "--", "true"], ["submit", "--nice", "+3", "--gpus", "1", "--", "true"],
    ["submit", "--class", "Batch", "--gpus", "1", "--", "true"], ["submit", "--gpus", "1", "--"],
    ["queue", "extra"], ["show"], ["show", "1", "2"], ["cancel"], ["cancel", "x"],
])
def test_what_the_fast_path_leaves_to_click(argv: list[str]) -> None:
    assert fastpath.parse(argv) is None


def test_the_socket_forms_the_fast_path_takes() -> None:
    assert fastpath.parse(["queue"]) == (None, "queue", fastpath.parse(["--socket", "s", "queue"])[2])  # type: ignore[index]
    for argv in (["--socket", "/s", "show", "3"], ["--socket=/s", "show", "3"]):
        assert fastpath.parse(argv) == ("/s", "show", {"ref": (3, None), "as_json": False})


def test_shell_completion_is_left_to_click(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fastpath.COMPLETE_VAR, "bash_complete")
    assert fastpath.run(["queue"]) is None


def test_a_usage_problem_found_before_sending_is_left_to_click() -> None:
    """`--gpus` with `--mig` parses, but cannot run: click, not the fast path, says why (exit 2)."""
    assert fastpath.parse(["submit", "--gpus", "1", "--mig", "1g.10gb", "--", "true"]) is not None
    assert fastpath.run(["--socket", "/nonexistent/s", "submit", "--gpus", "1", "--mig", "1g.10gb", "--", "true"]) \
        is None


# ---- both programs, as processes, against the real daemon ---------------------------------------

FAST_PROGRAM = "import sys; from gpusched_cli.fastpath import main; sys.argv[0] = 'gpusched'; main()"
CLICK_PROGRAM = "import sys; from gpusched_cli.main import cli; sys.argv[0] = 'gpusched'; cli()"


def _run(program: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", program, *args], capture_output=True, text=True, timeout=60,
                          check=False)


def _both(args: list[str]) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    return _run(FAST_PROGRAM, args), _run(CLICK_PROGRAM, args)


@pytest.fixture
def node(daemon_factory: Callable[..., DaemonHandle]) -> DaemonHandle:
    return daemon_factory(allow_root_jobs=os.geteuid() == 0)


def test_the_fast_path_prints_what_click_prints(node: DaemonHandle) -> None:
    sock = ["--socket", node.socket]
    fast, slow = _both([*sock, "submit", "--hold", "--gpus", "1", "--name", "n\x1b[2Jx", "--", "true"])
    assert fast.returncode == slow.returncode == 0 and fast.stderr == slow.stderr == ""
    first, second = int(fast.stdout.split()[-1]), int(slow.stdout.split()[-1])
    assert fast.stdout == f"Submitted job {first}\n" and slow.stdout == f"Submitted job {second}\n"
    fast, slow = _both([*sock, "submit", "--hold", "--json", "--gpus", "1", "--array", "0-3%2", "--", "true"])
    assert fast.stdout.startswith('{"job_id":') and slow.stdout.startswith('{"job_id":')
    for args in (["show", str(first)], ["show", "--json", str(first)], ["queue", "--limit", "2"],
                 ["show", "999999"], ["show", f"{first}_1"], ["logs", str(first)]):
        fast, slow = _both([*sock, *args])
        if args[0] == "show" and args[-1] == str(first):  # "pending for" times differ by the second
            fast_out, slow_out = fast.stdout.split("\n")[:3], slow.stdout.split("\n")[:3]
        elif args[0] == "queue":  # and so may the WAIT/RUNTIME column, if the second turns between the runs
            fast_out, slow_out = ([re.sub(r"\b\d+:\d\d\b", "M:SS", p.stdout)] for p in (fast, slow))
        else:
            fast_out, slow_out = [fast.stdout], [slow.stdout]
        assert (fast.returncode, fast_out, fast.stderr) == (slow.returncode, slow_out, slow.stderr), args
    assert "\\x1b[2J" in _both([*sock, "show", str(first)])[0].stdout  # escaped on both paths
    fast = _run(FAST_PROGRAM, [*sock, "cancel", str(first)])
    slow = _run(CLICK_PROGRAM, [*sock, "cancel", str(second)])
    assert fast.returncode == slow.returncode == 0
    assert fast.stdout.replace(str(first), "ID") == slow.stdout.replace(str(second), "ID") == "Cancelled job ID\n"


def test_no_daemon_reads_the_same_both_ways(tmp_path: Any) -> None:
    for args in (["queue"], ["submit", "--gpus", "1", "--", "true"], ["show", "1"], ["cancel", "1"]):
        fast, slow = _both(["--socket", str(tmp_path / "none.sock"), *args])
        assert fast.returncode == slow.returncode == 3, args
        assert fast.stderr == slow.stderr and "gpuschedd is not running" in fast.stderr
