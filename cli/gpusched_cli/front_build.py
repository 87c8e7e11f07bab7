"""Build and install the C front of `gpusched` (front.c): `python -m gpusched_cli.front_build` (run by
`make`), with the Python of the installation it belongs to.

The front takes the plain `gpusched submit` without starting an interpreter and runs this Python
program for everything else, so it is built for one interpreter (sys.executable, fixed in the
binary) and installed over the console script `gpusched` of that interpreter's environment: the
command users type becomes the fast one. Optional, like the compiled scheduling core: without a C
compiler the console script stays, the same program a Python start slower. `pip install` writes the
console script again; run this again after it (`status` says which one is installed).
"""

from __future__ import annotations

import os
import sys
import sysconfig

from gpusched.tools.cbuild import compile_into

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "front.c")
MARK = b"from gpusched_cli.fastpath import resume"  # a text only the front's binary holds


def installed_path() -> str:
    """The console script `gpusched` of this interpreter's environment, where the front goes."""
    return os.path.join(sysconfig.get_path("scripts"), "gpusched")


def _c_string(text: str) -> str:
    """`text` as a C string literal; only printable ASCII without quotes or backslashes is taken, so
    no escaping can go wrong."""
    if not text.isascii() or not text.isprintable() or '"' in text or "\\" in text:
        raise RuntimeError(f"the interpreter's path {text!r} holds characters the build does not quote")
    return f'"{text}"'


def build(target: str, python: str = sys.executable, source: str = SOURCE, cc: str | None = None) -> str:
    """Compile the front for `python` into `target`, replacing it whole; returns `target`. Raises
    RuntimeError saying why not (then `target` is as it was)."""
    return compile_into(source, target, [f"GPUSCHED_PYTHON={_c_string(python)}"], cc=cc)


def is_front(path: str) -> bool:
    """Is the program at `path` the C front (not the console script)?"""
    try:
        with open(path, "rb") as f:
            return MARK in f.read()
    except OSError:
        return False


def describe_installed() -> str:
    """Which `gpusched` this environment runs (for `status` and the benchmarks' headers)."""
    target = installed_path()
    return f"{target}: {'the C front' if is_front(target) else 'the Python console script'}"


USAGE = """usage: python -m gpusched_cli.front_build [status]

  (no argument)  build the C front for this Python and install it over its `gpusched`
  status         say which `gpusched` this Python's environment has"""


def main(argv: list[str]) -> int:
    target = installed_path()
    if argv[1:] == ["status"]:
        print(describe_installed())
        return 0
    if argv[1:] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if argv[1:]:
        print(f"{USAGE}\nerror: unknown argument {argv[1]!r}", file=sys.stderr)
        return 2
    try:
        build(target)
    except (RuntimeError, OSError) as exc:
        print(f"the C front of gpusched not built ({exc}); `gpusched` stays the Python console script",
              file=sys.stderr)
        return 1
    print(f"built the C front of gpusched: {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
