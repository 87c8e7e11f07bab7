"""Build gpusched-execjob, the job's child in C (execjob.c), where the shim finds it:
`python -m gpusched.daemon.execjob_build` (run by `make`).

Optional, like the compiled scheduling core: without a C compiler the shim forks a Python child
instead, which becomes the job the same way, a few milliseconds slower. The binary is named by its
source's checksum (shim.execjob_path), so an edited source is never served by an older build; the
older builds are removed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

from gpusched.daemon.shim import EXECJOB_DIR, EXECJOB_SOURCE, execjob_path

CFLAGS = ("-O2", "-Wall", "-Wextra", "-Werror")
# Linked statically where the C library's static archive is installed (Debian's libc6-dev has it):
# no dynamic loader between the helper's exec and its first step, ~0.2 ms of every job's start on
# two slow cores. It calls no NSS function (the groups come from the shim), so a static glibc is
# whole here. Without the archive, the dynamic build: the same program.
STATIC = ("-static",)


def build(source: str = EXECJOB_SOURCE, out_dir: str = EXECJOB_DIR, cc: str | None = None) -> str:
    """Compile `source` into `out_dir`; returns the binary's path. Raises RuntimeError saying why not."""
    target = execjob_path(source, out_dir)
    if target is None:
        raise RuntimeError(f"cannot read {source}")
    compiler = cc or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    os.makedirs(out_dir, mode=0o755, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".build-")
    os.close(fd)
    try:
        done = subprocess.run([compiler, *CFLAGS, *STATIC, "-o", tmp, source], capture_output=True, text=True)
        if done.returncode != 0:  # (no static C library): dynamically linked
            done = subprocess.run([compiler, *CFLAGS, "-o", tmp, source], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {(done.stderr or done.stdout).strip()[-2000:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)  # whole or not at all: a shim never runs half a binary
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    for name in os.listdir(out_dir):  # builds of older texts
        path = os.path.join(out_dir, name)
        if name.startswith("gpusched-execjob-") and path != target:
            os.unlink(path)
    return target


def main(argv: list[str]) -> int:
    try:
        path = build()
    except (RuntimeError, OSError) as exc:
        print(f"gpusched-execjob not built: {exc}", file=sys.stderr)
        return 1
    print(f"built {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
