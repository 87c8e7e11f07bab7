"""Build gpusched-execjob, the job's child in C (execjob.c), where the shim finds it:
`python -m gpusched.daemon.execjob_build` (run by `make`).

Optional, like the compiled scheduling core: without a C compiler the shim forks a Python child
instead, which becomes the job the same way, a few milliseconds slower. The binary is named by its
source's checksum (shim.execjob_path), so an edited source is never served by an older build; the
older builds are removed.
"""

from __future__ import annotations

import os
import sys

from gpusched.daemon.shim import EXECJOB_DIR, EXECJOB_SOURCE, execjob_path
from gpusched.tools.cbuild import compile_into


def build(source: str = EXECJOB_SOURCE, out_dir: str = EXECJOB_DIR, cc: str | None = None) -> str:
    """Compile `source` into `out_dir`; returns the binary's path. Raises RuntimeError saying why not."""
    target = execjob_path(source, out_dir)
    if target is None:
        raise RuntimeError(f"cannot read {source}")
    os.makedirs(out_dir, mode=0o755, exist_ok=True)
    compile_into(source, target, cc=cc)  # whole or not at all: a shim never runs half a binary
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
