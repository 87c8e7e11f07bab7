"""gpuschedd refuses a broken config file: non-zero exit, and a message naming the file, the line (for
TOML syntax errors) and the key, before it creates a socket or touches the state directory.

The real program is run: `python -m gpusched.daemon.main --config F --sim H100-80GB:1 --socket S
--state-dir D`.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import wait_until

# name -> (file contents, text the one-line message must contain besides the file name)
CASES: dict[str, tuple[bytes, list[str]]] = {
    "toml-syntax": (b'tick_s = 0.2\nkill_grace_s = = 2\n', ["not valid TOML", "line 2"]),
    "toml-unclosed-table": (b'tick_s = 0.2\n\n[gpus.0\nshare = "mps"\n', ["not valid TOML", "line 3"]),
    "toml-duplicate-key": (b'tick_s = 0.2\ntick_s = 0.3\n', ["not valid TOML", "line 2"]),
    "unknown-key": (b'tick_s = 0.2\nmax_conections = 10\n', ["max_conections", "Extra inputs are not permitted"]),
    "unknown-nested-key": (b'[gpus.0]\nshares = "mps"\n', ["gpus.0.shares", "Extra inputs are not permitted"]),
    "wrong-type": (b'tick_s = "fast"\n', ["tick_s", "valid number"]),
    "wrong-type-bool": (b'allow_root_jobs = "maybe"\n', ["allow_root_jobs", "valid boolean"]),
    "wrong-type-nested": (b'[gpus.0]\nmig = "3g.40gb"\n', ["gpus.0.mig", "valid list"]),
    "out-of-range": (b'max_connections = 0\n', ["max_connections", "greater than or equal to 1"]),
    "bad-choice": (b'[gpus.0]\nshare = "sometimes"\n', ["gpus.0.share", "'exclusive', 'mps' or 'timeslice'"]),
    "not-utf8": (b'tick_s = 0.2\n# caf\xe9\n', ["UTF-8"]),
    "slurm-dynamic-mig": (b'mode = "slurm-node"\n[gpus.0]\nmig = "dynamic"\n',
                          ["gpus.0.mig = \"dynamic\" cannot be used with mode = \"slurm-node\"", "slurm relayout"]),
    "bad-mode": (b'mode = "cluster"\n', ["mode", "'standalone' or 'slurm-node'"]),
}
XFAIL: dict[str, str] = {}  # cases that show a known daemon bug (strict xfail until fixed)


def run_daemon(tmp: str, config: bytes) -> tuple[subprocess.CompletedProcess[str], str]:
    path = os.path.join(tmp, "gpusched.toml")
    with open(path, "wb") as f:
        f.write(config)
    out = subprocess.run(
        [sys.executable, "-m", "gpusched.daemon.main", "--config", path, "--sim", "H100-80GB:1",
         "--socket", os.path.join(tmp, "g.sock"), "--state-dir", os.path.join(tmp, "state")],
        capture_output=True, text=True, timeout=60,
    )
    return out, path


@pytest.mark.parametrize("case", [
    pytest.param(name, marks=[pytest.mark.xfail(strict=True, reason=XFAIL[name])] if name in XFAIL else [])
    for name in CASES
])
def test_broken_config_is_refused_with_file_line_and_key(case: str, tmp_path: object) -> None:
    tmp = str(tmp_path)
    content, wanted = CASES[case]
    out, path = run_daemon(tmp, content)
    assert out.returncode != 0, f"gpuschedd started with a broken config:\n{out.stderr}"
    assert "Traceback" not in out.stderr, out.stderr
    message = out.stderr.strip()
    assert len(message.splitlines()) == 1, f"expected one line, got:\n{message}"
    assert message.startswith(f"gpuschedd: {path}: "), message
    for text in wanted:
        assert text in message, f"{text!r} not in {message!r}"
    assert not os.path.exists(os.path.join(tmp, "g.sock")), "a socket was created"
    assert not os.path.exists(os.path.join(tmp, "state")), "the state directory was created"


def test_missing_config_file_is_named(tmp_path: object) -> None:
    tmp = str(tmp_path)
    missing = os.path.join(tmp, "nope.toml")
    out = subprocess.run(
        [sys.executable, "-m", "gpusched.daemon.main", "--config", missing, "--sim", "H100-80GB:1",
         "--socket", os.path.join(tmp, "g.sock"), "--state-dir", os.path.join(tmp, "state")],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode != 0
    assert out.stderr.strip() == f"gpuschedd: {missing}: cannot read config file: No such file or directory"


def test_a_good_config_file_still_starts(tmp_path: object) -> None:
    """The same harness with a valid file: the daemon comes up (so the refusals above are about content)."""
    tmp = str(tmp_path)
    path = os.path.join(tmp, "gpusched.toml")
    with open(path, "w") as f:
        f.write('tick_s = 0.2\ncgroup_root = "off"\n[gpus.0]\nshare = "exclusive"\n')
    sock = os.path.join("/tmp", f"gs-badcfg-{os.getpid()}.sock")  # AF_UNIX path length limit
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpusched.daemon.main", "--config", path, "--sim", "H100-80GB:1",
         "--socket", sock, "--state-dir", os.path.join(tmp, "state")],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    with proc:
        try:
            wait_until(lambda: os.path.exists(sock) or proc.poll() is not None, timeout=30, what="socket")
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        finally:
            proc.terminate()
            proc.wait(30)
    assert proc.returncode == 0
