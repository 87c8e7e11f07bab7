"""The scheduling core compiled to C with mypyc, used only when it matches the sources exactly.

The core (`gpusched/core/`) is plain, fully typed Python, and stays the reference: every module runs
as it is. `python -m gpusched.native build` (run by `make`; needs a C compiler and mypy, the dev
extra) compiles those same modules with mypyc into `gpusched/core/_native/`, which roughly halves
the time of a scheduling pass (docs/benchmarks.md). A compiled module is loaded in place of its
source only while the build matches: `gpusched/core/__init__.py` puts `_native/` first on the
package's path when every source file hashes as it did at build time and the build is for this
Python, and leaves it out otherwise, so an edited source never runs as stale machine code. It is
all or nothing: compiled classes cannot be mixed with classes of a different build.

`GPUSCHED_PURE_PYTHON=1` keeps the compiled core out (the reference, for comparisons and for tests
that subclass the scheduler to check it from inside, which compiled classes do not allow).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile

CORE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "core")
NATIVE_DIR = os.path.join(CORE_DIR, "_native")
MANIFEST = "sources.json"
GROUP = "gpusched.core.native"  # the shared library: gpusched/core/_native/native__mypyc.*.so
PURE_ENV = "GPUSCHED_PURE_PYTHON"


def _abi() -> str:
    return str(sysconfig.get_config_var("EXT_SUFFIX"))


def _sources(core_dir: str = CORE_DIR) -> dict[str, str]:
    """Every module of the core, by file name, with the sha256 of its text."""
    found = {}
    for name in sorted(os.listdir(core_dir)):
        if name.endswith(".py"):
            with open(os.path.join(core_dir, name), "rb") as f:
                found[name] = hashlib.sha256(f.read()).hexdigest()
    return found


def usable_build(native_dir: str = NATIVE_DIR) -> str | None:
    """Why the compiled core cannot be used (None when it can): missing, switched off, built for
    another Python, or built from sources that have changed since."""
    if os.environ.get(PURE_ENV, "") not in ("", "0"):
        return f"{PURE_ENV} is set"
    try:
        with open(os.path.join(native_dir, MANIFEST), "rb") as f:
            manifest = json.loads(f.read())
    except FileNotFoundError:
        return "not built (python -m gpusched.native build)"
    except (OSError, ValueError) as exc:
        return f"its manifest cannot be read: {exc}"
    if not isinstance(manifest, dict) or manifest.get("abi") != _abi():
        return f"built for another Python (not {_abi()})"
    if manifest.get("sources") != _sources():
        return "built from other sources (rebuild: python -m gpusched.native build)"
    return None


def core_path(package_path: list[str]) -> bool:
    """Called by gpusched/core/__init__.py: put the compiled modules first on the core's path when
    they match the sources. Returns whether they are used."""
    if usable_build() is not None:
        return False
    package_path.insert(0, NATIVE_DIR)
    return True


class BuildError(Exception):
    """What the build needs and this machine lacks."""


def build(native_dir: str = NATIVE_DIR) -> None:
    """Compile every module of the core with mypyc into `native_dir` (replacing what was there).

    The manifest is written last, from the copy of the sources that was compiled, so a build that
    fails or is interrupted leaves nothing that would be loaded, and one that raced an edit is not
    loaded either."""
    compiler = (os.environ.get("CC") or str(sysconfig.get_config_var("CC") or "cc")).split()[0]
    if shutil.which(compiler) is None:
        raise BuildError(f"no C compiler ({compiler}) on PATH")
    try:
        from mypyc.build import mypycify  # the dev extra; imported here, as nothing else needs it
        from setuptools import Distribution
    except ImportError as exc:
        raise BuildError(f"{exc.name} is not installed (pip install mypy setuptools)") from None

    shutil.rmtree(native_dir, ignore_errors=True)
    package = os.path.dirname(CORE_DIR)
    with tempfile.TemporaryDirectory(prefix="gpusched-native-") as tmp:
        # mypy type-checks what it compiles from a copy of the package: in an installed copy the
        # directory above the package is site-packages, whose modules mypy would take for ours.
        shutil.copytree(package, os.path.join(tmp, "src", "gpusched"),
                        ignore=shutil.ignore_patterns("__pycache__", "_native*", "*.so"))
        sources = _sources(os.path.join(tmp, "src", "gpusched", "core"))  # exactly what is compiled
        cwd = os.getcwd()
        os.chdir(os.path.join(tmp, "src"))
        try:
            paths = [os.path.join("gpusched", "core", name) for name in sources if name != "__init__.py"]
            # (--ignore-missing-imports: sortedcontainers ships without types, as pyproject.toml says)
            extensions = mypycify(["--ignore-missing-imports", *paths], opt_level="3",
                                  target_dir=os.path.join(tmp, "c"), group_name=GROUP)
            # A bare Distribution: setup() would look for packaging settings in the directory.
            dist = Distribution({"name": "gpusched-native", "ext_modules": extensions})
            dist.script_args = ["-q", "build_ext", "--build-lib", os.path.join(tmp, "lib"),
                                "--build-temp", os.path.join(tmp, "tmp")]
            dist.parse_command_line()
            dist.run_commands()
        finally:
            os.chdir(cwd)
        built = os.path.join(tmp, "lib", "gpusched", "core")
        staging = f"{native_dir}.new"
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
        for name in os.listdir(built):
            if name.endswith(_abi()):
                shutil.copy2(os.path.join(built, name), staging)
        with open(os.path.join(staging, MANIFEST), "w") as f:
            json.dump({"abi": _abi(), "sources": sources}, f, indent=1)
        os.rename(staging, native_dir)


def main(argv: list[str]) -> int:
    if argv == ["build"]:
        try:
            build()
        except BuildError as exc:
            print(f"gpusched: cannot compile the core: {exc}", file=sys.stderr)
            return 1
        reason = usable_build()
        print("gpusched: compiled core built in gpusched/core/_native" if reason is None
              else f"gpusched: compiled core built but not usable: {reason}")
        return 0 if reason is None else 1
    if argv == ["status"]:
        reason = usable_build()
        print("compiled (mypyc)" if reason is None else f"pure Python: {reason}")
        return 0
    print("usage: python -m gpusched.native build|status", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
