"""Compiling the project's small C programs (the job's child, the client's front) into place: whole
or not at all, static where the C library's archive is installed, dynamic otherwise.

Both are optional: a caller turns RuntimeError into "not built, the Python stand-in runs".
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence

CFLAGS = ("-O2", "-Wall", "-Wextra", "-Werror")
# Static where the C library's static archive is installed (Debian's libc6-dev has it): no dynamic
# loader between the exec and main, ~0.2-0.3 ms a start on two slow cores. Neither program calls an
# NSS function, so a static glibc is whole for them. Without the archive, the dynamic build.
STATIC = ("-static",)


def compiler(cc: str | None = None) -> str:
    """`cc`, else $CC, else cc or gcc on PATH; RuntimeError when there is none."""
    found = cc or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if found is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    return found


def compile_into(source: str, target: str, defines: Sequence[str] = (), cc: str | None = None) -> str:
    """Compile `source` (with `-D` `defines`) and put the program at `target` by rename, so nobody
    ever runs half a binary and a failed build leaves `target` as it was; returns `target`. Raises
    RuntimeError with the compiler's message."""
    command = [compiler(cc), *CFLAGS, *(f"-D{define}" for define in defines)]
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(target)), prefix=".build-")
    os.close(fd)
    try:
        done = subprocess.run([*command, *STATIC, "-o", tmp, source], capture_output=True, text=True)
        if done.returncode != 0:  # (no static C library): dynamically linked
            done = subprocess.run([*command, "-o", tmp, source], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{command[0]} failed: {(done.stderr or done.stdout).strip()[-2000:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
