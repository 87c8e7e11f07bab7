"""Small /proc readers the daemon uses to tell what a job's processes are doing.

Every job is a session leader, so "the job's processes" are the processes whose session id is the
job's pid. Readers return None / empty for processes that vanish while being read (they do).
"""

from __future__ import annotations

import os
from collections.abc import Collection


def _stat_fields(pid: int) -> list[bytes] | None:
    """Fields 3.. of /proc/PID/stat (state first); None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name may contain spaces and parentheses: fields start after the last ')'.
    fields = stat[stat.rindex(b")") + 2 :].split()
    return fields if len(fields) > 3 else None


def session_of(pid: int) -> int | None:
    """The session id of `pid` (every process of a job shares the job's: it is a session leader)."""
    fields = _stat_fields(pid)
    try:
        return int(fields[3]) if fields is not None else None
    except ValueError:
        return None


def session_states(sessions: Collection[int]) -> dict[int, set[str]]:
    """Process states (R, S, D, T, t, Z, ...) of the live members of each session, in one /proc scan."""
    states: dict[int, set[str]] = {sid: set() for sid in sessions}
    if not states:
        return states
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = _stat_fields(int(name))
        if fields is None:
            continue
        try:
            sid = int(fields[3])
        except ValueError:
            continue
        if sid in states:
            states[sid].add(fields[0].decode(errors="replace"))
    return states


def session_members(sid: int) -> list[int]:
    """The live (not zombie) processes of a session, in one /proc scan."""
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = _stat_fields(int(name))
        if fields is not None and fields[3] == str(sid).encode() and fields[0] not in (b"Z", b"X"):
            members.append(int(name))
    return sorted(members)


STOPPED_STATES = frozenset({"T", "t", "Z", "X"})  # stopped, traced, or already dead


def is_running(states: set[str]) -> bool:
    """Does any process of a session run (or wait to), rather than sit stopped or dead?"""
    return bool(states - STOPPED_STATES)


def lock_holder(path: str) -> int | None:
    """The pid holding an flock on `path` (from /proc/locks, matched by inode); None if unlocked."""
    try:
        st = os.stat(path)
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" (blocked waiters have a "->" field)
        if len(parts) < 6 or parts[1] != "FLOCK" or "->" in parts:
            continue
        try:
            dev_ino = parts[5].split(":")
            if int(dev_ino[2]) == st.st_ino and os.makedev(int(dev_ino[0], 16), int(dev_ino[1], 16)) == st.st_dev:
                return int(parts[4])
        except (IndexError, ValueError):
            continue
    return None


def session_leaders_under(parent: int) -> list[int]:
    """Children of `parent` that lead their own session (what a shim forks: the job)."""
    leaders: list[int] = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = _stat_fields(int(name))
        if fields is not None and fields[1] == str(parent).encode() and fields[3] == name.encode():
            leaders.append(int(name))
    return leaders
