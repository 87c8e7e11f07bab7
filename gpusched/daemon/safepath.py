"""Whether a directory the daemon keeps its state or its socket in is safe from other users.

A personal (unprivileged) daemon's defaults live under the user's home or `/tmp/gpusched-$UID`,
which another local user can create first: a directory they own, or one they may write, lets them
swap the daemon's socket or its state (a planted log file read a job's output). So each component
of the path, as given and as resolved, must belong to the daemon's user or to root, and must not
be writable by everyone unless it is root's and sticky (`/tmp`). A group-writable home directory
(user private groups) is accepted, as the group is the user's own.
"""

from __future__ import annotations

import os
import pwd
import stat


def unsafe_reason(path: str, euid: int) -> str | None:
    """Why `path` (an existing or to-be-created directory) is not safe for a daemon running as
    `euid`, or None. Components that do not exist yet are not checked (the daemon creates them)."""
    absolute = os.path.abspath(path)
    for candidate in dict.fromkeys([absolute, os.path.realpath(absolute)]):
        parts = candidate.split(os.sep)
        for i in range(1, len(parts) + 1):
            prefix = os.sep.join(parts[:i]) or os.sep
            try:
                st = os.lstat(prefix)
            except FileNotFoundError:
                break
            except OSError as exc:
                return f"{prefix}: {exc.strerror or exc}"
            if st.st_uid not in (euid, 0):
                return f"{prefix} belongs to {_name(st.st_uid)}, not to {_name(euid)} or root"
            if stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_IWOTH and not (
                    st.st_uid == 0 and st.st_mode & stat.S_ISVTX):
                return f"{prefix} is writable by every user (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"
