"""Text primitives of the CLI's output: sizes, durations, times, signals, device names, tables, and
escaping what a terminal would act on. Pure and standard library only (every command imports them).
render.py builds each command's output from these and re-exports them.
"""

from __future__ import annotations

import re

TYPE_CHECKING = False  # typing costs the fast path a few ms to import; mypy reads this as True
if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence
    from datetime import tzinfo

_UNITS = ("MiB", "GiB", "TiB", "PiB")

# Characters a terminal acts on instead of showing: C0 controls (ESC starts CSI/OSC sequences such as
# "clear screen" or OSC 52 "write the clipboard"), DEL, C1 controls (U+009B is a one-byte CSI), and
# the invisible format characters that reorder or hide text (bidi overrides, zero-width marks).
_CONTROL = "\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff"
_UNSAFE_TEXT = re.compile(f"[{_CONTROL}]")
_UNSAFE_CELL = re.compile(f"[\t\n{_CONTROL}]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str, *, one_line: bool = False) -> str:
    """`text` with every character a terminal would act on shown as an escape (`\\x1b`, `\\u202e`).

    Job names, commands, reasons and user names come from other users: printed raw, they could clear
    another user's screen or write their clipboard. `one_line` also escapes tabs and newlines (table cells).
    """
    return (_UNSAFE_CELL if one_line else _UNSAFE_TEXT).sub(_escape, text)


def format_mib(mib: float) -> str:
    """`512 MiB`, `80 GiB`, `1.5 GiB`: the largest unit that keeps the number >= 1, one decimal at most."""
    value = float(mib)
    unit = 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value /= 1024
        unit += 1
    text = f"{value:.1f}".rstrip("0").rstrip(".")
    return f"{text} {_UNITS[unit]}"


def format_duration(seconds: float) -> str:
    """Slurm's elapsed-time shape: `M:SS`, `H:MM:SS`, `D-HH:MM:SS`; `submit --time` reads it back."""
    total = max(0, int(seconds))
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}-{hours:02d}:{minutes:02d}:{secs:02d}"
    if hours:
        return f"{hours}:{minutes:02d}:{secs:02d}"
    return f"{minutes}:{secs:02d}"


def format_time(epoch: float | None, tz: tzinfo | None = None) -> str:
    """Local wall-clock time to the second (`2024-05-01 14:03:07`); `-` when there is none."""
    if epoch is None:
        return "-"
    from datetime import datetime  # only where a time is shown

    moment = datetime.fromtimestamp(epoch, tz) if tz is not None else datetime.fromtimestamp(epoch)
    return moment.strftime("%Y-%m-%d %H:%M:%S")


def format_signal(signum: int) -> str:
    """`9 (SIGKILL)`: numbers for scripts, names for people."""
    import signal  # its enum classes cost every command's start; only a signal's name needs them

    try:
        return f"{signum} ({signal.Signals(signum).name})"
    except ValueError:
        return str(signum)


_UUID_RE = re.compile(r"^((?:GPU|MIG)-)([0-9a-fA-F]{8})-[0-9a-fA-F-]+$")


def short_device(device: str) -> str:
    """`GPU-1a2b3c4d` for a full NVML UUID, so a table row fits; anything else is shown as is."""
    match = _UUID_RE.match(device)
    return match.group(1) + match.group(2) if match else device


def table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """Left-aligned columns two spaces apart; the last column is not padded (no trailing blanks)."""
    all_rows = [list(headers), *[[printable(cell, one_line=True) for cell in r] for r in rows]]
    widths = [max(len(r[i]) for r in all_rows) for i in range(len(headers))]
    lines = []
    for row in all_rows:
        cells = [cell.ljust(widths[i]) for i, cell in enumerate(row[:-1])] + [row[-1]]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
