"""What the user guide shows a new user is what the programs print (an audit of the fresh-clone
experience found the version line, the completion example and a hint's promise out of date)."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
UG = (REPO / "docs" / "user-guide.md").read_text()


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpusched_cli.main", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, check=False)


def test_user_guide_version_line_matches_the_client() -> None:
    shown = re.search(r"```sh\ngpusched --version\n```\n```\n(.*)\n```", UG).group(1)  # type: ignore[union-attr]
    assert _cli("--version").stdout.strip() == shown


def test_user_guide_completion_example_matches() -> None:
    shown = re.search(r"completes `gpusched s<TAB>` to `([^`]*)`", UG).group(1).split()  # type: ignore[union-attr]
    out = _cli(env={"_GPUSCHED_COMPLETE": "bash_complete", "COMP_WORDS": "gpusched s", "COMP_CWORD": "1"}).stdout
    got = [line.split(",", 1)[1] for line in out.splitlines() if line.startswith("plain,")]
    assert got == shown


def test_hint_points_to_gpuschedd_help_which_must_say_where_it_listens(tmp_path: Path) -> None:
    path = str(tmp_path / "dg.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(path)
        err = _cli("--socket", path, "queue").stderr
    assert "`gpuschedd --help` shows where it listens" in err
    helptext = subprocess.run([sys.executable, "-m", "gpusched.daemon.main", "--help"], capture_output=True,
                              text=True, check=False).stdout
    assert "/run/gpusched/gpusched.sock" in helptext, helptext
