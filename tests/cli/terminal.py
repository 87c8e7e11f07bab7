"""`gpusched top` in a real terminal (tmux) for the tests: the same server and environment for all.

A tmux server of this test process's own: a server already running (the user's default one, or
another test process's under pytest -n) would start a command with its environment, not ours, and
so with another daemon's socket. And no COLUMNS or LINES, which curses prefers to the terminal's
own size (pytest-xdist's workers have them set to 80x24).
"""

from __future__ import annotations

import os

TMUX = ["tmux", "-L", f"gs-tests-{os.getpid()}"]


def terminal_env(socket: str) -> dict[str, str]:
    """The environment of a command run in a tmux session: the CLI reaches the daemon on `socket`."""
    return {**{k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")},
            "GPUSCHED_SOCKET": socket, "TERM": "xterm"}
