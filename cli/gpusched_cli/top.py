"""`gpusched top`: a live view driven by the daemon's `watch` stream (it pushes; we never poll).

`render_top` is a pure function from a snapshot and the view's settings to lines of text, so the
screen and `--once` show the same thing and tests need no terminal. The curses loop only draws
those lines and reads keys; a thread reads frames from the socket.
"""

from __future__ import annotations

import contextlib
import curses
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import tzinfo

from gpusched.protocol import GpuInfo, GpusResult, ProtocolError, TopJob, TopSnapshot, WatchRequest
from gpusched_cli.client import Client, DaemonUnavailable
from gpusched_cli.render import device_labels, format_duration, format_mib, format_time, printable, table

SORTS = ("id", "user", "runtime", "memory")
BAR_WIDTH = 20


@dataclass
class View:
    """What the person at the keyboard chose."""

    sort: str = "id"
    user: str | None = None
    paused: bool = False
    message: str = ""
    hidden_events: set[int] = field(default_factory=set)


def render_top(snap: TopSnapshot, view: View, width: int = 120, tz: tzinfo | None = None) -> list[str]:
    labels = device_labels(GpusResult(backend="", driver_version="", gpus=snap.gpus))
    running = sum(1 for j in snap.running if j.state.value == "RUNNING")
    head = (f"gpusched top  {format_time(snap.now, tz)}  {len(snap.gpus)} GPUs  {running} running  "
            f"{snap.pending_total} pending" + ("  [PAUSED]" if view.paused else "")
            + (f"  user={view.user}" if view.user else "") + f"  sort={view.sort}")
    lines = [head, ""]
    for gpu in snap.gpus:
        lines += _gpu_lines(gpu, width)
    lines.append("")
    jobs = _sorted([j for j in snap.running if view.user in (None, j.user)], view.sort, snap.now)
    lines.append(f"Running ({len(jobs)})")
    rows = [(str(j.id), j.user, j.name[:20], ", ".join(labels.get(d, d[:12]) for d in j.devices),
             format_duration(snap.now - (j.started_at or snap.now)),
             format_mib(j.gpu_mem_mib) if j.gpu_mem_mib is not None else "-", j.state.value) for j in jobs]
    lines += _indent(table(("ID", "USER", "NAME", "DEVICE", "RUNTIME", "GPU MEM", "STATE"), rows)) if rows \
        else ["  none"]
    lines.append("")
    lines.append(f"Queue by user ({snap.pending_total} pending)")
    users = [u for u in snap.users if view.user in (None, u.user)]
    urows = [(u.user, f"{u.weight:g}", str(u.running), str(u.pending), f"{u.service_gpu_h:.2f}",
              _signed(u.lag_gpu_s) if u.lag_gpu_s is not None else "-",
              str(u.next_job) if u.next_job is not None else "-") for u in users]
    lines += _indent(table(("USER", "WEIGHT", "RUNNING", "PENDING", "GPU-H", "LAG GPU-S", "NEXT"), urows)) \
        if urows else ["  none"]
    lines.append("")
    lines.append("Recent events")
    events = snap.events[-8:]
    lines += [f"  {format_time(e.at, tz)}  {e.kind:<13} {e.message}" for e in events] or ["  none"]
    lines.append("")
    lines.append(view.message or "q quit  s sort  u filter user  p pause")
    return [printable(line, one_line=True)[:width] for line in lines]  # names and reasons are other users' text


def _gpu_lines(gpu: GpuInfo, width: int) -> list[str]:
    used = gpu.memory_used_mib or 0
    mem = _bar(used / gpu.memory_total_mib if gpu.memory_total_mib else 0.0)
    health = "" if gpu.health == "ok" else f"  [{gpu.health}]"
    lines = [f"GPU {gpu.index} {gpu.model:<10} mem {mem} {format_mib(used)}/{format_mib(gpu.memory_total_mib)}"
             f"  {'MIG' if gpu.mig_enabled else _whole(gpu)}"
             f"{'' if gpu.share == 'exclusive' else ' ' + gpu.share}{' interactive' if gpu.interactive else ''}"
             f"{health}"]
    if gpu.mig_enabled:
        lines.append("  " + mig_strip(gpu, max(40, width - 4)))
    elif gpu.jobs:
        lines.append(f"  jobs {', '.join(map(str, gpu.jobs))} ({', '.join(gpu.users)})")
    return lines


def _whole(gpu: GpuInfo) -> str:
    """`whole`, or for an AMD logical GPU where it sits: `p0 2/8 CPX/NPS1` is partition 2 of the 8
    of physical GPU 0, in CPX/NPS1 mode."""
    p = gpu.partition
    if p is None:
        return "whole"
    return f"p{p.physical_index} {p.index_in_physical}/{p.count} {p.compute_mode}/{p.memory_mode}"


def mig_strip(gpu: GpuInfo, width: int) -> str:
    """The 8 memory slices as a strip: each instance a bracketed span with its profile and job."""
    cell = max(4, width // 8)
    spans: list[tuple[int, int, str]] = []
    for inst in sorted(gpu.instances, key=lambda i: i.start):
        who = f" #{','.join(map(str, inst.jobs))} {','.join(inst.users)}" if inst.jobs else " idle"
        spans.append((inst.start, inst.size, f"{inst.profile}{who}"))
    out, pos = [], 0
    for start, size, label in spans:
        out += ["." * cell] * (start - pos)
        span = cell * size
        out.append("[" + label[: span - 2].ljust(span - 2) + "]")
        pos = start + size
    out += ["." * cell] * (8 - pos)
    return "".join(out)


def _signed(value: float) -> str:
    """`+12` / `-3`, and `+0` rather than `-0` for a lag that rounds to nothing."""
    return f"{0.0 if abs(value) < 0.5 else value:+.0f}"


def _bar(fraction: float) -> str:
    filled = round(max(0.0, min(1.0, fraction)) * BAR_WIDTH)
    return "[" + "#" * filled + "-" * (BAR_WIDTH - filled) + "]"


def _sorted(jobs: list[TopJob], sort: str, now: float) -> list[TopJob]:
    if sort == "user":
        return sorted(jobs, key=lambda j: (j.user, j.id))
    if sort == "runtime":
        return sorted(jobs, key=lambda j: -(now - (j.started_at or now)))
    if sort == "memory":
        return sorted(jobs, key=lambda j: -(j.gpu_mem_mib or 0))
    return sorted(jobs, key=lambda j: j.id)


def _indent(text: str) -> list[str]:
    return ["  " + line for line in text.splitlines()]


# ---- the live screen -----------------------------------------------------------------------------


def first_snapshot(client: Client) -> TopSnapshot:
    """One snapshot (`top --once`): start the stream, take its first frame."""
    reply = client.raw_call(WatchRequest().model_dump(mode="json"))
    return _snapshot(reply)


def _snapshot(reply: dict[str, object]) -> TopSnapshot:
    if reply.get("ok") is not True:
        err = reply.get("error") or {}
        raise RuntimeError(str(err.get("message", "watch refused") if isinstance(err, dict) else err))
    return TopSnapshot.model_validate(reply["result"])


def run_live(client: Client) -> None:
    """Full-screen view until `q`. Frames arrive on a thread; the screen redraws on frames and keys."""
    frames: queue.Queue[TopSnapshot | BaseException] = queue.Queue()

    def receive() -> None:
        try:
            frames.put(first_snapshot(client))
            while True:
                frames.put(_snapshot(client.read_reply()))
        except BaseException as exc:
            frames.put(exc)

    threading.Thread(target=receive, name="gpusched-top-frames", daemon=True).start()
    ended = curses.wrapper(_screen, frames)
    if ended is not None:  # raised with the terminal restored: the CLI maps it to its exit code (3)
        if isinstance(ended, (ConnectionError, TimeoutError, DaemonUnavailable, ProtocolError)):
            raise ended
        raise DaemonUnavailable(f"the connection to the daemon ended: {ended}", "try again in a moment")


def _screen(stdscr: curses.window, frames: queue.Queue[TopSnapshot | BaseException]) -> BaseException | None:
    """Draw until `q` (None) or until the stream ends (what ended it, to raise once curses is gone)."""
    with contextlib.suppress(curses.error):  # (a terminal without a cursor to hide)
        curses.curs_set(0)
    stdscr.timeout(100)
    view, snap = View(), None
    while True:
        with contextlib.suppress(queue.Empty):
            while True:
                item = frames.get_nowait()
                if isinstance(item, BaseException):
                    return item
                if not view.paused:
                    snap = item
        key = stdscr.getch()
        if key in (ord("q"), ord("Q")):
            return None
        if key == ord("s"):
            view.sort = SORTS[(SORTS.index(view.sort) + 1) % len(SORTS)]
        elif key == ord("p"):
            view.paused = not view.paused
        elif key == ord("u"):
            view.user = _prompt(stdscr, "filter by user (empty for all): ") or None
        if snap is not None:
            _draw(stdscr, render_top(snap, view, width=max(20, stdscr.getmaxyx()[1] - 1)))


def _prompt(stdscr: curses.window, label: str) -> str:
    """Read a line on the bottom row; a window too narrow for the label gets a shorter one, and one
    too small for any gives up (empty: the filter is cleared) instead of a curses error."""
    height, width = stdscr.getmaxyx()
    label = label if len(label) < width - 8 else "user: "
    stdscr.timeout(-1)
    curses.echo()
    try:
        stdscr.addstr(height - 1, 0, label[: max(0, width - 2)])
        stdscr.clrtoeol()
        return stdscr.getstr(height - 1, len(label), max(1, min(64, width - len(label) - 1))).decode(
            errors="replace").strip()
    except curses.error:
        return ""
    finally:
        curses.noecho()
        stdscr.timeout(100)


def _draw(stdscr: curses.window, lines: Sequence[str]) -> None:
    stdscr.erase()
    height, _ = stdscr.getmaxyx()
    for row, line in enumerate(lines[: height - 1]):
        with contextlib.suppress(curses.error):
            stdscr.addstr(row, 0, line)
    stdscr.refresh()
