"""One daemon per state directory: an exclusive lock on STATE/gpuschedd.lock for the daemon's life.

The socket check (server.claim_socket_path) only sees a daemon that is already listening, and only
on the same socket path: a second `gpuschedd --socket /tmp/x.sock` on the service's state directory,
or two daemons started at the same moment, would each run recovery and a scheduler against one
database and put two jobs on one GPU. The kernel drops an flock with its last descriptor, so a
daemon killed with SIGKILL leaves no stale lock behind; the descriptor is close-on-exec and the
fork server closes every inherited descriptor (forkserver.main), so no job or shim keeps it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os

LOCK_NAME = "gpuschedd.lock"


class StateLocked(Exception):
    """Another live process holds the state directory."""


class StateLock:
    """Held from `acquire` until `release` (or the process's end)."""

    def __init__(self, state_dir: str) -> None:
        self.path = os.path.join(state_dir, LOCK_NAME)
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise StateLocked naming the holder; OSError if the file cannot be opened."""
        # O_NOFOLLOW: the state directory is root's (0711), but a lock file must never be a link
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            who = f"pid {holder}" if holder else "another process"
            raise StateLocked(f"another gpuschedd ({who}) is using the state directory "
                              f"{os.path.dirname(self.path)}; stop it first, or give this one its own "
                              "--state-dir") from None
        except BaseException:
            os.close(fd)
            raise
        with contextlib.suppress(OSError):  # only a courtesy for the message above
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
