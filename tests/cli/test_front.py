"""The C front of `gpusched` (cli/gpusched_cli/front.c): the plain submit without a Python start.

It must send, byte for byte, the frame the Python program sends for the same command line, print
what it prints, and hand every other command line to it before sending anything. Each front is
built here twice: for this interpreter (as `make` installs it) and for an interpreter that does not
exist, so that a front that handed over to Python fails loudly: `alone` exiting 0 proves the front
did the submit itself, and `alone` failing with nothing received proves it handed over untouched.
The daemon is a recording one (a real Unix socket, the real framing) that answers as scripted, or
the real daemon for the end-to-end case.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gpusched import wire
from gpusched_cli import front_build, run_submit, submitspec
from gpusched_cli.client import Client
from gpusched_cli.parse import parse_size_mib
from gpusched_cli.run_submit import SUBMIT, time_limit
from tests.conftest import DaemonHandle, short_tmpdir, wait_until

MISSING_PYTHON = "/nonexistent/python-for-the-front-test"
PYTHON_CLI = [sys.executable, "-P", "-c", "from gpusched_cli.fastpath import main; main()"]
HELLO_1_1 = {"ok": True, "result": {"version": "1.1", "daemon_version": "test"}}
QUEUED = {"ok": True, "result": {"job_id": 7, "state": "PENDING", "duplicate": False}}


@dataclass
class Fronts:
    front: str  # for this interpreter
    alone: str  # for a missing one: fails wherever it would hand over


@pytest.fixture(scope="module")
def fronts(tmp_path_factory: pytest.TempPathFactory) -> Fronts:
    if shutil.which("cc") is None and shutil.which("gcc") is None and not os.environ.get("CC"):
        pytest.skip("no C compiler: the front is optional (`gpusched` stays the Python console script)")
    out = tmp_path_factory.mktemp("front")
    return Fronts(front_build.build(str(out / "front")),
                  front_build.build(str(out / "alone"), python=MISSING_PYTHON))


@dataclass
class Recorder:
    """A daemon that records every frame and answers `hello` with `hello`, each submit with the next
    of `answers` (a reply object, a reply's raw body, or None: close the connection unanswered), the
    last one repeating."""

    path: str
    hello: dict[str, Any] = field(default_factory=lambda: HELLO_1_1)
    answers: list[dict[str, Any] | bytes | None] = field(default_factory=lambda: [QUEUED])
    submits: list[bytes] = field(default_factory=list)
    hellos: int = 0

    def __post_init__(self) -> None:
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(self.path)
        self.server.listen(64)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with conn:
                self._talk(conn)

    def _talk(self, conn: socket.socket) -> None:
        while True:
            header = conn.recv(4, socket.MSG_WAITALL)
            if len(header) < 4:
                return
            body = conn.recv(wire.HEADER.unpack(header)[0], socket.MSG_WAITALL)
            op = json.loads(body)["op"]
            if op == "hello":
                self.hellos += 1
                reply: dict[str, Any] | bytes | None = self.hello
            else:
                self.submits.append(body)
                reply = self.answers[min(len(self.submits), len(self.answers)) - 1]
            if reply is None:
                return
            conn.sendall(wire.frame(reply if isinstance(reply, bytes) else json.dumps(reply).encode()))

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def recorder() -> Iterator[Callable[..., Recorder]]:
    made: list[Recorder] = []

    def make(path: str | None = None, **kwargs: Any) -> Recorder:
        made.append(Recorder(path or os.path.join(short_tmpdir(), "g.sock"), **kwargs))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _run(program: list[str], args: list[str], env: dict[str, str] | None = None, cwd: str | None = None,
         **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*program, *args], capture_output=True, text=True, timeout=60, env=env, cwd=cwd, check=False,
                          **kwargs)


def _masked(frame: bytes) -> tuple[bytes, str]:
    """The frame with its request_id cut out, and the request_id."""
    match = re.search(rb',"request_id":"([0-9a-f]{32})"}$', frame)
    assert match is not None, frame[-200:]
    return frame[:match.start()], match.group(1).decode()


# ---- what the front sends itself ------------------------------------------------------------------

_TEXT = st.text(st.characters(min_codepoint=1, max_codepoint=127), max_size=12)
_NAME = st.text(st.characters(min_codepoint=ord("A"), max_codepoint=ord("Z")) | st.just("_"), min_size=1, max_size=8)


def _accepted(convert: Callable[[str], Any]) -> Callable[[str], bool]:
    def check(text: str) -> bool:
        try:
            convert(text)
        except ValueError:
            return False
        return True
    return check


def _suffixed(parts: list[tuple[str, int]], cases: list[bool]) -> str:
    return "".join(f"{n}{unit.upper() if upper else unit}" for (unit, n), upper in zip(parts, cases, strict=False))


# --time in each form the front takes itself (no blanks): suffixes in order, Slurm's forms.
_TIMES = st.one_of(
    st.builds(_suffixed, st.lists(st.sampled_from("dhms"), min_size=1, max_size=4, unique=True).flatmap(
        lambda units: st.tuples(*[st.tuples(st.just(u), st.integers(0, 400)) for u in sorted(units, key="dhms".index)])
    ).map(list), st.lists(st.booleans(), min_size=4, max_size=4)),
    st.builds(lambda d, h, m, sec, shape: shape.format(d=d, h=h, m=m, s=sec), st.integers(0, 400),
              st.integers(0, 99), st.integers(0, 9999), st.integers(0, 99),
              st.sampled_from(["{m}", "{m}:{s}", "{h}:{m}:{s}", "{d}-{h}", "{d}-{h}:{m}", "{d}-{h}:{m}:{s}",
                               "0{m}"])),
).filter(_accepted(time_limit))
# --mem as a whole number with an optional unit, B or iB, in any case.
_SIZES = st.builds(lambda n, unit, tail: f"{n}{unit}{tail if unit else ''}", st.integers(1, 10**7),
                   st.sampled_from(["", "k", "K", "m", "M", "g", "G", "t", "T"]),
                   st.sampled_from(["", "b", "B", "ib", "iB", "IB"])).filter(
    lambda text: _accepted(parse_size_mib)(text) and parse_size_mib(text) <= wire.MAX_MEM_MIB)


@st.composite
def plain_submits(draw: st.DrawFn) -> tuple[list[str], dict[str, str]]:
    """A command line the front takes whole, in any order and form, and extra environment."""
    options: list[list[str]] = []

    def valued(flag: str, value: str) -> list[str]:
        use_eq = value[:1] == "-" or draw(st.booleans())
        return [f"{flag}={value}"] if use_eq else [flag, value]

    if draw(st.booleans()):
        options.append(valued("--gpus", draw(st.sampled_from(["1", "2", "8", "64", "01"]))))
    else:
        options.append(valued("--mig", draw(st.sampled_from(["1g.10gb", "3g.40gb", "7g.80gb", "1g.20gb+me"]))))
    if draw(st.booleans()):
        options.append(valued("--name", draw(_TEXT)))
    if draw(st.booleans()):
        options.append(valued("--class", draw(st.sampled_from(["batch", "interactive"]))))
    if draw(st.booleans()):
        options.append(valued("--nice", str(draw(st.integers(0, 19)))))
    if draw(st.booleans()):
        options.append(valued("--cpus", str(draw(st.integers(1, 4096)))))
    if draw(st.booleans()):
        options.append(valued("--precision", draw(st.sampled_from(["fp16", "bf16", "fp32", "tf32"]))))
    if draw(st.booleans()):
        options.append(valued("--export", "ALL"))
    if draw(st.booleans()):
        options.append(valued("--time", draw(_TIMES)))
    if draw(st.booleans()):
        options.append(valued("--mem", draw(_SIZES)))
    for flag in ("--requeue", "--hold", "--json"):
        if draw(st.booleans()):
            options.append([flag])
    options = draw(st.permutations(options))
    program = draw(st.sampled_from(["true", "sh", "./run me", "a\"b\\c", "x\x01y", "\t\x7fz"]))
    args = draw(st.lists(_TEXT, max_size=4))
    dash = draw(st.booleans()) or program[:1] == "-"
    argv = ["submit", *[part for option in options for part in option], *(["--"] if dash else []), program, *args]
    env = draw(st.dictionaries(_NAME, _TEXT, max_size=4))
    return argv, env


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(submit=plain_submits(), by_option=st.booleans())
@example(submit=(["submit", "--mig", "1g.10gb", "true"], {"LC_CTYPE": "0"}), by_option=False)  # PEP 538 coerces it
def test_the_front_sends_the_frame_python_sends(fronts: Fronts, recorder: Callable[..., Recorder],
                                                submit: tuple[list[str], dict[str, str]], by_option: bool,
                                                tmp_path: Path) -> None:
    args, extra = submit
    daemon = recorder()
    env = {k: v for k, v in os.environ.items() if k != "GPUSCHED_SOCKET"} | extra
    if by_option:
        args = ["--socket", daemon.path, *args]
    else:
        env["GPUSCHED_SOCKET"] = daemon.path
    began = time.time_ns()
    ours = _run([fronts.alone], args, env=env, cwd=str(tmp_path))
    python = _run(PYTHON_CLI, args, env=env, cwd=str(tmp_path))
    ended = time.time_ns()
    assert (ours.returncode, ours.stdout, ours.stderr) == (python.returncode, python.stdout, python.stderr) == (
        0, python.stdout, ""), ours.stderr
    assert len(daemon.submits) == 2
    (front_frame, front_id), (python_frame, python_id) = map(_masked, daemon.submits)
    assert front_frame == python_frame
    assert front_id != python_id
    # both made as resubmit.new_request_id makes them: the time in nanoseconds first, so in order
    assert began <= int(front_id[:16], 16) < int(python_id[:16], 16) <= ended


@pytest.mark.parametrize(("flag", "values"), [
    ("--time", ["90", "10:30", "1:02:03", "2-3", "2-3:04", "2-3:04:05", "30s", "5M", "2h", "1d", "1h30m",
                "1D2h3M4S", "007", "365d", "0-0:0:1"]),
    ("--mem", ["1", "1k", "1023K", "1025k", "512M", "10G", "1GiB", "2gb", "1T", "3tib", "8388607T"]),
])
def test_each_form_of_a_time_and_a_size_is_read_as_python_reads_it(
        fronts: Fronts, recorder: Callable[..., Recorder], flag: str, values: list[str], tmp_path: Path) -> None:
    daemon = recorder()
    for value in values:
        args = ["--socket", daemon.path, "submit", "--gpus", "1", flag, value, "--", "true"]
        ours, python = _run([fronts.alone], args, cwd=str(tmp_path)), _run(PYTHON_CLI, args, cwd=str(tmp_path))
        assert ours.returncode == python.returncode == 0, (value, ours.stderr)
        front_frame, python_frame = (_masked(frame)[0] for frame in daemon.submits[-2:])
        assert front_frame == python_frame, value


def test_the_front_finds_a_users_own_daemon_as_python_does(fronts: Fronts, recorder: Callable[..., Recorder],
                                                            tmp_path: Path) -> None:
    runtime = short_tmpdir()
    os.mkdir(os.path.join(runtime, "gpusched"))
    daemon = recorder(path=os.path.join(runtime, "gpusched", "gpusched.sock"))
    env = {k: v for k, v in os.environ.items() if k != "GPUSCHED_SOCKET"} | {"XDG_RUNTIME_DIR": runtime + "/"}
    if os.path.exists(wire.ROOT_SOCKET):
        pytest.skip(f"a system daemon's socket exists here ({wire.ROOT_SOCKET}); discovery would try it first")
    done = _run([fronts.alone], ["submit", "--gpus", "1", "--", "true"], env=env, cwd=str(tmp_path))
    assert (done.returncode, done.stdout) == (0, "Submitted job 7\n"), done.stderr
    assert len(daemon.submits) == 1


# ---- what it hands to Python before sending anything -----------------------------------------------

HANDED_OVER = [
    ["queue"],
    ["submit", "--help"],
    ["submit", "--gpus", "1", "--time", " 5", "--", "true"],  # blanks: Python's, which takes them
    ["submit", "--gpus", "1", "--time", "0", "--", "true"],
    ["submit", "--gpus", "1", "--time", "0s", "--", "true"],
    ["submit", "--gpus", "1", "--time", "366d", "--", "true"],
    ["submit", "--gpus", "1", "--time", "1h1d", "--", "true"],
    ["submit", "--gpus", "1", "--time", "1h30", "--", "true"],
    ["submit", "--gpus", "1", "--time", "5\n", "--", "true"],
    ["submit", "--gpus", "1", "--time", "1:2:3:4", "--", "true"],
    ["submit", "--gpus", "1", "--time", "9999999999", "--", "true"],
    ["submit", "--gpus", "1", "--mem", "1.5G", "--", "true"],  # a fraction: Python's, which takes it
    ["submit", "--gpus", "1", "--mem", "0G", "--", "true"],
    ["submit", "--gpus", "1", "--mem", "10 G", "--", "true"],
    ["submit", "--gpus", "1", "--mem", "8388608T", "--", "true"],
    ["submit", "--gpus", "1", "--mem", "1Gb2", "--", "true"],
    ["submit", "--gpus", "1", "--wait", "--", "true"],
    ["submit", "--gpus", "1", "--array", "1-3", "--", "true"],
    ["submit", "--gpus", "1", "--after", "3", "--", "true"],
    ["submit", "--share", "0.5", "--gpu-mem", "1G", "--", "true"],
    ["submit", "--partition", "cpx", "--", "true"],
    ["submit", "--gpus", "1", "--export", "NONE", "--", "true"],
    ["submit", "--gpus", "0", "--", "true"],
    ["submit", "--gpus", "+1", "--", "true"],
    ["submit", "--gpus", "65", "--", "true"],
    ["submit", "--gpus", "1", "--cpus", "0", "--", "true"],
    ["submit", "--gpus", "1", "--nice", "20", "--", "true"],
    ["submit", "--gpus", "1", "--gpus", "2", "--", "true"],
    ["submit", "--gpus", "1", "--mig", "1g.10gb", "--", "true"],
    ["submit", "--", "true"],
    ["submit", "--gpus", "1"],
    ["submit", "--gpus", "1", "--", " \t"],
    ["submit", "--gpus", "1", "--class", "Batch", "--", "true"],
    ["submit", "--mig", "1g.10gb\n", "--", "true"],
    ["submit", "--gpus", "1", "--name", "n" * 129, "--", "true"],
    ["submit", "--gpus", "1", "--name", "caf\u00e9", "--", "true"],
    ["submit", "--gpus", "1", "--", "caf\u00e9"],
    ["submit", "--gpus", "1", "--json=1", "--", "true"],
    ["submit", "-g", "1", "--", "true"],
    ["--socket", "x", "--socket", "y", "submit", "--gpus", "1", "--", "true"],
]


@pytest.mark.parametrize("args", HANDED_OVER, ids=lambda args: " ".join(args)[:60])
def test_what_the_front_leaves_to_python_reads_as_python(fronts: Fronts, recorder: Callable[..., Recorder],
                                                          args: list[str], tmp_path: Path) -> None:
    daemon = recorder()
    env = os.environ | {"GPUSCHED_SOCKET": daemon.path}
    alone = _run([fronts.alone], args, env=env, cwd=str(tmp_path))
    assert alone.returncode == 1 and f"cannot run {MISSING_PYTHON}" in alone.stderr
    assert daemon.submits == []  # handed over before anything was sent
    ours = _run([fronts.front], args, env=env, cwd=str(tmp_path))
    python = _run(PYTHON_CLI, args, env=env, cwd=str(tmp_path))
    assert (ours.returncode, ours.stdout, ours.stderr) == (python.returncode, python.stdout, python.stderr)


def test_an_environment_python_would_read_otherwise_goes_to_python(fronts: Fronts, recorder: Callable[..., Recorder],
                                                                   tmp_path: Path) -> None:
    daemon = recorder()
    env = os.environ | {"GPUSCHED_SOCKET": daemon.path, "GREETING": "gr\u00fc\u00df"}
    alone = _run([fronts.alone], ["submit", "--gpus", "1", "--", "true"], env=env, cwd=str(tmp_path))
    assert alone.returncode == 1 and daemon.submits == []


def test_a_variable_given_twice_goes_to_python(fronts: Fronts, recorder: Callable[..., Recorder],
                                              tmp_path: Path) -> None:
    """Python keeps a variable's first value; the front leaves such an environment to it."""
    daemon = recorder()
    exec_with_raw_environment = (
        "import ctypes, sys\n"
        "def strings(items): return (ctypes.c_char_p * (len(items) + 1))(*[i.encode() for i in items], None)\n"
        "env = ['PATH=/usr/bin:/bin', 'TWICE=1', 'TWICE=2', 'GPUSCHED_SOCKET=' + sys.argv[2]]\n"
        "ctypes.CDLL(None).execve(sys.argv[1].encode(), strings(sys.argv[1:2] + sys.argv[3:]), strings(env))\n")
    done = _run([sys.executable, "-c", exec_with_raw_environment, fronts.alone, daemon.path],
                ["submit", "--gpus", "1", "--", "true"], cwd=str(tmp_path))
    assert done.returncode == 1 and f"cannot run {MISSING_PYTHON}" in done.stderr
    assert daemon.submits == []


def test_a_spec_that_may_be_near_the_size_limit_goes_to_python(fronts: Fronts, recorder: Callable[..., Recorder],
                                                                tmp_path: Path) -> None:
    """Past submitspec.might_be_invalid's bound (4 bytes a character) the model judges the spec's real
    size: Python's call. This one is within the limit, so Python sends it."""
    daemon = recorder()
    env = os.environ | {"GPUSCHED_SOCKET": daemon.path, "BIG": "x" * (submitspec.MAX_SPEC_BYTES // 4)}
    args = ["submit", "--gpus", "1", "--", "true"]
    alone = _run([fronts.alone], args, env=env, cwd=str(tmp_path))
    assert alone.returncode == 1 and daemon.submits == []
    done = _run([fronts.front], args, env=env, cwd=str(tmp_path))
    assert (done.returncode, done.stdout) == (0, "Submitted job 7\n"), done.stderr
    assert len(daemon.submits) == 1


def test_shell_completion_goes_to_python(fronts: Fronts, recorder: Callable[..., Recorder], tmp_path: Path) -> None:
    daemon = recorder()
    env = os.environ | {"GPUSCHED_SOCKET": daemon.path, "_GPUSCHED_COMPLETE": "bash_source"}
    alone = _run([fronts.alone], ["submit", "--gpus", "1", "--", "true"], env=env, cwd=str(tmp_path))
    assert alone.returncode == 1 and daemon.submits == []


def test_no_daemon_reads_as_python(fronts: Fronts, tmp_path: Path) -> None:
    args = ["--socket", str(tmp_path / "none.sock"), "submit", "--gpus", "1", "--", "true"]
    ours, python = _run([fronts.front], args, cwd=str(tmp_path)), _run(PYTHON_CLI, args, cwd=str(tmp_path))
    assert (ours.returncode, ours.stdout, ours.stderr) == (python.returncode, python.stdout, python.stderr)
    assert ours.returncode == 3 and "gpuschedd is not running" in ours.stderr


def test_a_protocol_1_0_daemon_is_left_to_python(fronts: Fronts, recorder: Callable[..., Recorder],
                                                 tmp_path: Path) -> None:
    daemon = recorder(hello={"ok": True, "result": {"version": "1.0"}})
    args = ["--socket", daemon.path, "submit", "--gpus", "1", "--", "true"]
    assert _run([fronts.alone], args, cwd=str(tmp_path)).returncode == 1 and daemon.submits == []
    done = _run([fronts.front], args, cwd=str(tmp_path))
    assert (done.returncode, done.stdout) == (0, "Submitted job 7\n"), done.stderr
    assert b"request_id" not in daemon.submits[0]  # sent once, as Python sends to a 1.0 daemon


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the socket to another user")
def test_a_foreign_socket_is_refused_before_anything_is_sent(fronts: Fronts, recorder: Callable[..., Recorder],
                                                             tmp_path: Path) -> None:
    daemon = recorder()
    os.chown(daemon.path, 65534, 65534)
    args = ["--socket", daemon.path, "submit", "--gpus", "1", "--", "true"]
    alone = _run([fronts.alone], args, cwd=str(tmp_path))
    assert alone.returncode == 1 and daemon.submits == []
    ours, python = _run([fronts.front], args, cwd=str(tmp_path)), _run(PYTHON_CLI, args, cwd=str(tmp_path))
    assert (ours.returncode, ours.stderr) == (python.returncode, python.stderr)
    assert "refusing to use" in ours.stderr and daemon.submits == []


# ---- what it hands to Python after sending -----------------------------------------------------------

def _sent_twice_with_one_id(daemon: Recorder) -> None:
    assert len(daemon.submits) == 2
    (first, first_id), (second, second_id) = map(_masked, daemon.submits)
    assert (first, first_id) == (second, second_id)  # the very request again: a queued job is not queued twice


@pytest.mark.parametrize(("answer", "code"), [
    ({"code": "limit_exceeded", "message": "you have 1000 pending jobs", "hint": "wait for some"}, 8),
    ({"code": "unsatisfiable", "message": "no GPU has \x1b[2J 9 GPUs", "hint": ""}, 6),
    ({"code": "bad_request", "message": "spec.argv: bad", "hint": "see docs"}, 1),
])
def test_a_refused_submit_is_reported_by_python(fronts: Fronts, recorder: Callable[..., Recorder],
                                               answer: dict[str, Any], code: int, tmp_path: Path) -> None:
    daemon = recorder(answers=[{"ok": False, "error": answer}])
    args = ["--socket", daemon.path, "submit", "--gpus", "1", "--", "true"]
    ours = _run([fronts.front], args, cwd=str(tmp_path))
    _sent_twice_with_one_id(daemon)
    python = _run(PYTHON_CLI, args, cwd=str(tmp_path))
    assert (ours.returncode, ours.stdout, ours.stderr) == (python.returncode, python.stdout, python.stderr)
    assert ours.returncode == code and ours.stderr.startswith("error: ")


def test_a_connection_lost_after_sending_is_resent_with_the_same_request_id(
        fronts: Fronts, recorder: Callable[..., Recorder], tmp_path: Path) -> None:
    daemon = recorder(answers=[None, QUEUED])
    done = _run([fronts.front], ["--socket", daemon.path, "submit", "--json", "--gpus", "1", "--", "true"],
                cwd=str(tmp_path))
    assert (done.returncode, done.stdout, done.stderr) == (0, '{"job_id":7,"state":"PENDING"}\n', "")
    _sent_twice_with_one_id(daemon)


@pytest.mark.parametrize("result", [
    {"job_id": "7", "state": "PENDING"},  # a shape the front does not read: Python's int() does
    {"job_id": 7, "state": "PENDING", "tasks": 3},
    {"job_id": 7, "state": "PEND\u0130NG"},
    {"job_id": 7},
    b'{"ok":true,"result":{"job_id":07,"state":"PENDING"}}',  # not JSON: Python says so
    b'{"ok":true,"result":{"job_id":7,"state":"PENDING"},"result":{"job_id":8,"state":"PENDING"}}',
])
def test_an_answer_the_front_does_not_read_is_read_by_python(fronts: Fronts, recorder: Callable[..., Recorder],
                                                             result: dict[str, Any] | bytes, tmp_path: Path) -> None:
    daemon = recorder(answers=[result if isinstance(result, bytes) else {"ok": True, "result": result}])
    args = ["--socket", daemon.path, "submit", "--gpus", "1", "--", "true"]
    ours = _run([fronts.front], args, cwd=str(tmp_path))
    _sent_twice_with_one_id(daemon)
    python = _run(PYTHON_CLI, args, cwd=str(tmp_path))
    assert (ours.returncode, ours.stdout, ours.stderr) == (python.returncode, python.stdout, python.stderr)


def test_a_closed_output_exits_as_python_does(fronts: Fronts, recorder: Callable[..., Recorder],
                                              tmp_path: Path) -> None:
    daemon = recorder()
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([fronts.alone, "--socket", daemon.path, "submit", "--gpus", "1", "--", "true"],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60, cwd=str(tmp_path),
                              check=False)
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (141, "")
    assert len(daemon.submits) == 1


# ---- with the real daemon ----------------------------------------------------------------------------

def test_a_job_submitted_by_the_front_is_the_job_python_submits(fronts: Fronts, daemon: DaemonHandle,
                                                                tmp_path: Path) -> None:
    args = ["--socket", daemon.socket, "submit", "--gpus", "1", "--name", "same", "--time", "1h", "--mem", "1G",
            "--hold", "--", "sh", "-c", "echo 'it works'"]
    ours = _run([fronts.alone], args, cwd=str(tmp_path))
    python = _run(PYTHON_CLI, args, cwd=str(tmp_path))
    assert ours.returncode == python.returncode == 0, ours.stderr
    ids = [int(done.stdout.split()[-1]) for done in (ours, python)]
    with Client(daemon.socket) as c:
        shown = [c.request({"op": "show", "job_id": job_id})["job"] for job_id in ids]
    assert [job["state"] for job in shown] == ["HELD", "HELD"]
    assert shown[0]["spec"] == shown[1]["spec"]
    with Client(daemon.socket) as c:
        c.request({"op": "release", "job_ids": [ids[0]]})
    wait_until(lambda: _state(daemon, ids[0]) == "COMPLETED", what="the front's job to run")


def _state(daemon: DaemonHandle, job_id: int) -> str:
    with Client(daemon.socket) as c:
        return str(c.request({"op": "show", "job_id": job_id})["job"]["state"])


# ---- the source and the build ----------------------------------------------------------------------

def _defines() -> dict[str, str]:
    text = Path(front_build.SOURCE).read_text()
    return dict(re.findall(r"^#define (\w+) (.+?)\s*(?:/\*.*)?$", text, flags=re.M))


def test_the_fronts_numbers_are_the_protocols() -> None:
    defines = _defines()
    assert json.loads(defines["ROOT_SOCKET"]) == wire.ROOT_SOCKET
    assert json.loads(defines["PROTOCOL_VERSION"]) == wire.PROTOCOL_VERSION
    assert defines["MAX_FRAME"] == "(1u << 20)" and wire.MAX_FRAME == 1 << 20
    assert defines["MAX_SPEC_BYTES"] == "(256u * 1024u)" and submitspec.MAX_SPEC_BYTES == 256 * 1024
    assert defines["SPEC_STRING_OVERHEAD"] == f"{submitspec.SPEC_STRING_OVERHEAD}u"
    assert defines["MAX_NAME"] == f"{submitspec.MAX_NAME}u"
    assert defines["MAX_PROFILE"] == f"{submitspec.MAX_PROFILE}u"
    assert defines["MAX_TIME_LIMIT_S"] == "(365L * 86400L)" and run_submit.MAX_TIME_LIMIT_S == 365 * 86400
    assert defines["MAX_MEM_MIB"] == "((1LL << 43) - 1)" and wire.MAX_MEM_MIB == (1 << 43) - 1


def test_every_submit_option_is_known_to_the_front() -> None:
    """An option the front does not know would send the command line to Python (safe, but slow):
    a new option of `submit` is added to the front's table, taken or marked Python's."""
    table = set(re.findall(r'\{"(--[a-z-]+)", O_', Path(front_build.SOURCE).read_text()))
    assert table == set(SUBMIT.by_flag)


def test_a_failed_build_leaves_the_installed_program_as_it_was(tmp_path: Path) -> None:
    target = tmp_path / "gpusched"
    target.write_text("#!/bin/sh\necho console script\n")
    broken = tmp_path / "broken.c"
    broken.write_text("int main(void) { return }\n")
    with pytest.raises(RuntimeError, match="failed"):
        front_build.build(str(target), source=str(broken))
    assert target.read_text() == "#!/bin/sh\necho console script\n"
    assert not front_build.is_front(str(target))
    assert sorted(os.listdir(tmp_path)) == ["broken.c", "gpusched"]  # no half-built file left


def test_an_interpreter_path_the_build_cannot_quote_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="does not quote"):
        front_build.build(str(tmp_path / "gpusched"), python='/opt/py"thon')


def test_the_built_front_is_recognised(fronts: Fronts) -> None:
    assert front_build.is_front(fronts.front)


def test_the_build_command_says_what_it_takes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert front_build.main(["front_build", "--help"]) == 0
    assert "status" in capsys.readouterr().out
    assert front_build.main(["front_build", "stats"]) == 2  # a typo builds nothing
    assert "unknown argument 'stats'" in capsys.readouterr().err
