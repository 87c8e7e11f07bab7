"""Parsing of what users type: memory sizes and time limits.

Pure functions that raise `ValueError` with a message fit to show after the flag's name, so the
CLI can say `--gpu-mem: ...` without knowing the grammar. The formats mirror what GPU users already
type elsewhere: sizes like `nvidia-smi`/Docker (`10G`, `512M`), time limits like Slurm's `--time`.
"""

from __future__ import annotations

import math
import re

TYPE_CHECKING = False  # typing costs the fast path a few ms to import; mypy reads this as True
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Literal

# All size units are binary: GPU memory is sold and reported in GiB, and `10G` meaning 10 GiB is
# what users of CUDA_MPS_PINNED_DEVICE_MEM_LIMIT and Docker expect.
_SIZE_UNITS: dict[str, float] = {
    "": 1.0,  # a bare number is MiB, the unit NVML and nvidia-smi report
    "k": 1 / 1024,
    "m": 1.0,
    "g": 1024.0,
    "t": 1024.0 * 1024.0,
}
# Patterns are kept as text and matched through re's own cache, so each is compiled the first time it
# is used, not at every start of the client (compiling the module's five cost ~2 ms on the fast path).
_SIZE_RE = r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(?:([kmgt])(?:i?b)?)?\s*$"


def parse_size_mib(text: str) -> int:
    """`10G`, `512M`, `1024` (MiB), `1.5GiB` -> whole MiB, rounded up so a cap is never below the ask."""
    match = re.match(_SIZE_RE, text, re.IGNORECASE)
    if not match:
        raise ValueError(
            f"{text!r} is not a size; use a number with an optional unit K, M, G or T "
            "(binary: 10G = 10 GiB; a bare number is MiB), e.g. 10G, 512M, 1.5GiB"
        )
    number, unit = match.groups()
    mib = float(number) * _SIZE_UNITS[(unit or "").lower()]
    if not math.isfinite(mib):
        raise ValueError(f"{text!r} is too large")
    if mib <= 0:
        raise ValueError(f"{text!r} must be larger than zero")
    return max(1, math.ceil(mib - 1e-9))  # (the 1e-9 forgives float noise; anything above zero is 1 MiB at least)


_SUFFIX_RE = r"^(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$"
_SLURM_RE = r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$"


def parse_duration_s(text: str) -> int:
    """A time limit in seconds, in Slurm's `--time` forms or with unit suffixes.

    Slurm forms: `M`, `M:S`, `H:M:S`, `D-H`, `D-H:M`, `D-H:M:S` (`90` is 90 minutes, as in Slurm).
    Suffix forms: `30s`, `5m`, `2h`, `1d`, and combinations such as `1h30m`.
    """
    s = text.strip()
    suffix = re.match(_SUFFIX_RE, s, re.IGNORECASE)
    if s and suffix and any(suffix.groups()):
        d, h, m, sec = (int(g) if g else 0 for g in suffix.groups())
        total = ((d * 24 + h) * 60 + m) * 60 + sec
    else:
        slurm = re.match(_SLURM_RE, s)
        if not slurm:
            raise ValueError(
                f"{text!r} is not a time limit; use minutes (90), M:S (10:00), H:M:S (1:00:00), "
                "D-H:M:S (2-00:00:00), or a suffix: 30s, 5m, 2h, 1d, 1h30m"
            )
        days_s, first, second, third = slurm.groups()
        a = int(first)
        b = int(second) if second is not None else None
        c = int(third) if third is not None else None
        if days_s is not None:
            # With days the first field is hours: D-H, D-H:M, D-H:M:S.
            total = ((int(days_s) * 24 + a) * 60 + (b or 0)) * 60 + (c or 0)
        elif c is not None:
            total = (a * 60 + (b or 0)) * 60 + c  # H:M:S
        elif b is not None:
            total = a * 60 + b  # M:S
        else:
            total = a * 60  # M
    if total <= 0:
        raise ValueError(f"{text!r} must be longer than zero")
    return total


_AFTER_RE = r"^\s*(\d+)(?:_(\d+))?\s*(?::\s*(ok|any)\s*)?$"


def parse_dependencies(text: str) -> list[tuple[int, int | None, Literal["ok", "any"]]]:
    """`--after 12`, `12:any`, `12,13:ok`, `120_7` -> [(job or array id, task or None, "ok"|"any")];
    `ok` (ended COMPLETED) by default. `120_7` is task 7 of array 120."""
    out: list[tuple[int, int | None, Literal["ok", "any"]]] = []
    for part in text.split(","):
        match = re.match(_AFTER_RE, part, re.IGNORECASE)
        if not match or int(match.group(1)) < 1:
            raise ValueError(
                f"{part.strip()!r} is not a dependency; use a job id or an array task (120_7), optionally "
                "with :ok (it must end COMPLETED, the default) or :any (it may end any way), e.g. 12, 12:any, "
                "12,13:any, 120_7"
            )
        task = None if match.group(2) is None else int(match.group(2))
        out.append((int(match.group(1)), task, "any" if (match.group(3) or "").lower() == "any" else "ok"))
    return out


_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"


def parse_export(text: str, environ: Mapping[str, str]) -> dict[str, str]:
    """`--export` as sbatch reads it: the environment a job starts with.

    `ALL` (the default) is the whole submitting environment; `NONE` is nothing (the daemon still
    supplies HOME, USER, LOGNAME, SHELL and PATH); otherwise a comma-separated list of `NAME` (taken
    from the submitting environment, skipped if unset) and `NAME=value`, optionally starting with
    `ALL` to add to the whole environment instead of to nothing.
    """
    # Blanks around an item's name are not part of it; a value is taken as given, as sbatch does.
    items = [item.lstrip() for item in text.split(",") if item.strip()]
    if not items:
        raise ValueError("give ALL, NONE, or a comma-separated list of NAME or NAME=value")
    head = items[0].strip().upper()
    if head == "NONE" and len(items) == 1:
        return {}
    env: dict[str, str] = dict(environ) if head == "ALL" else {}
    for item in items[1:] if head in ("ALL", "NONE") else items:
        name, eq, value = item.partition("=")
        name = name.strip()
        if not re.match(_ENV_NAME, name):
            raise ValueError(f"{name!r} is not a variable name")
        if eq:
            env[name] = value
        elif name in environ:
            env[name] = environ[name]
    return env
