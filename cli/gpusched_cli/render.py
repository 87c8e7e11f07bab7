"""Human output of the CLI: tables, times, sizes. Pure functions of their arguments.

Everything a command prints for people is built here from protocol results, so the formats can be
unit-tested without a daemon and `main.py` stays about talking to one. `now` and the time zone are
arguments for the same reason. Scripts should use `--json`; these formats may change.
"""

from __future__ import annotations

import re
import shlex
import signal
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, tzinfo

from gpusched.arrayspec import compress
from gpusched.model import TERMINAL_STATES, WAITING_STATES, Job, JobState, describe_request
from gpusched.protocol import (
    ArraySummary,
    CancelResult,
    DoctorResult,
    GpuInfo,
    GpusResult,
    JobsChanged,
    JobSummary,
    ShowResult,
    StatsResult,
)

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
    moment = datetime.fromtimestamp(epoch, tz) if tz is not None else datetime.fromtimestamp(epoch)
    return moment.strftime("%Y-%m-%d %H:%M:%S")


def format_signal(signum: int) -> str:
    """`9 (SIGKILL)`: numbers for scripts, names for people."""
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


def elapsed(job: JobSummary, now: float) -> float:
    """WAIT/RUNTIME column: waiting time for queued jobs, run time for started ones."""
    start = job.submitted_at if job.started_at is None else job.started_at
    end = job.ended_at if job.ended_at is not None else now
    return end - start


QUEUE_HEADERS = ("ID", "NAME", "USER", "STATE", "REQUEST", "DEVICES", "WAIT/RUNTIME", "REASON")


def device_labels(result: GpusResult) -> dict[str, str]:
    """UUID -> `gpu0` / `gpu1:3g.40gb@4`: what a person can find in `gpusched gpus` at a glance.

    UUIDs are unique but unreadable, and their first digits can be shared (the simulator's are).
    """
    labels: dict[str, str] = {}
    for gpu in result.gpus:
        labels[gpu.uuid] = f"gpu{gpu.index}"
        for inst in gpu.instances:
            labels[inst.uuid] = f"gpu{gpu.index}:{inst.profile}@{inst.start}"
    return labels


def job_ref(job: JobSummary | Job) -> str:
    """`123`, or `120_7` for task 7 of array 120: the form `show`, `logs` and `cancel` take back."""
    return f"{job.array_id}_{job.array_task}" if job.array_id is not None else str(job.id)


def array_ref(array: ArraySummary) -> str:
    """`123_[1-10000%8]`, as squeue writes an array: its id and its --array spec."""
    return f"{array.id}_[{array.spec}]"


def array_states(array: ArraySummary) -> str:
    """`RUNNING:8,PENDING:9990,COMPLETED:2`: active states first, then waiting, then finished."""
    order = {s.value: i for i, s in enumerate((JobState.STARTING, JobState.RUNNING, JobState.SUSPENDED,
                                               JobState.PREEMPTED, JobState.PENDING, JobState.HELD))}
    states = sorted(array.states.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0]))
    return ",".join(f"{state}:{count}" for state, count in states)


def queue_table(jobs: Sequence[JobSummary], now: float, labels: Mapping[str, str] | None = None,
                arrays: Sequence[ArraySummary] = ()) -> str:
    """The `gpusched queue` table; says so plainly when there is nothing to show.

    `labels` names devices (see `device_labels`); a device it does not know is shown as a short UUID.
    Each array is one row (`123_[1-10000%8]`, its tasks counted by state), in id order with the jobs.
    """
    if not jobs and not arrays:
        return "No jobs."
    names = labels or {}
    rows = [
        (
            j.id,
            (
                job_ref(j),
                j.name,
                j.user,
                j.state.value,
                j.request,
                ",".join(names.get(d) or short_device(d) for d in j.devices) or "-",
                format_duration(elapsed(j, now)),
                j.reason or "-",
            ),
        )
        for j in jobs
    ]
    rows += [
        (a.id, (array_ref(a), a.name, a.user, array_states(a), a.request, "-", format_duration(now - a.submitted_at),
                f"pending {a.pending}" if a.pending else "-"))
        for a in arrays
    ]
    return table(QUEUE_HEADERS, [row for _, row in sorted(rows, key=lambda r: r[0])])


def _exit_text(job: Job) -> str:
    parts = []
    if job.exit_code is not None:
        parts.append(f"exit code {job.exit_code}")
    if job.signal is not None:
        parts.append(f"killed by signal {format_signal(job.signal)}")
    return ", ".join(parts) or "-"


def show_text(result: ShowResult, now: float, tz: tzinfo | None = None) -> str:
    """The `gpusched show` page: what was asked, where the job is, what it got, and how it got there."""
    job = result.job
    spec = job.spec
    fields: list[tuple[str, str]] = [
        ("user", f"{job.user} (uid {job.uid}, gid {job.gid})"),
        ("command", shlex.join(spec.argv)),
        ("cwd", spec.cwd),
        ("request", describe_request(spec.request)),
        ("class", f"{spec.job_class}, nice {spec.nice}"),
        ("time limit", format_duration(spec.time_limit_s) if spec.time_limit_s else "none"),
        ("requeue", "yes" if spec.requeue else "no"),
        ("precision", spec.precision or "any"),
        ("submitted", format_time(job.submitted_at, tz)),
    ]
    if job.started_at is not None:
        fields.append(("started", format_time(job.started_at, tz)))
    if job.ended_at is not None:
        fields.append(("ended", format_time(job.ended_at, tz)))
    if job.started_at is not None:
        end = job.ended_at if job.ended_at is not None else now
        fields.append(("runtime", format_duration(end - job.started_at)))
    elif job.state in WAITING_STATES:
        fields.append(("waiting", format_duration(now - job.submitted_at)))
    if job.state in TERMINAL_STATES or job.exit_code is not None or job.signal is not None:
        fields.append(("result", _exit_text(job)))
    if job.reason:
        fields.append(("reason", job.reason))
    if result.waiting_reason:
        fields.append(("waiting for", result.waiting_reason))
    est = result.estimate
    if est is not None:
        length = format_duration(est.runtime_s) if est.runtime_s >= 1 else f"{est.runtime_s:.1f} s"
        fields.append(("estimate", f"{length} ({est.source})"))
        if est.expected_start_at is not None:
            fields.append(("est. start", f"{format_time(est.expected_start_at, tz)} "
                                         f"(in {format_duration(max(0.0, est.expected_start_at - now))})"))
        elif job.state in WAITING_STATES:
            fields.append(("est. start", "unknown (needs a MIG change, or too many jobs ahead)"))
        if est.expected_end_at is not None:
            fields.append(("est. end", f"{format_time(est.expected_end_at, tz)} "
                                       f"(in {format_duration(max(0.0, est.expected_end_at - now))})"))
    alloc = job.allocation
    if alloc is not None:
        for i, dev in enumerate(alloc.devices):
            what = f"GPU {dev.gpu_index}" + (f", MIG {dev.profile}" if dev.profile else "")
            fields.append(("devices" if i == 0 else "", f"{dev.uuid} ({what})"))
        if alloc.share is not None:
            fields.append(("share", f"{alloc.share:g} of the device's compute"))
        if alloc.gpu_mem_mib is not None:
            fields.append(("memory cap", format_mib(alloc.gpu_mem_mib)))
        for i, (key, value) in enumerate(sorted(alloc.env.items())):
            fields.append(("env added" if i == 0 else "", f"{key}={value}"))
    if job.pid is not None:
        fields.append(("pid", str(job.pid)))
    fields.append(("log", result.log_path or "-"))

    array = result.array
    if array is not None:
        fields.insert(0, ("array", f"task {job.array_task} of array {array_ref(array)}: {array.tasks} tasks"
                                   + (f", at most {array.max_running} at once" if array.max_running else "")
                                   + f"; {array_states(array)}"))
    width = max(len(k) for k, _ in fields)
    title = f"Job {job.id}" + (f" = {job_ref(job)}" if job.array_id is not None else "")
    lines = [f"{title} ({printable(job.display_name, one_line=True)})  {job.state.value}"]
    lines += [f"  {k.ljust(width)}  {printable(v, one_line=True)}" for k, v in fields]
    if job.history:
        lines.append("History:")
        rows = [(format_time(t.at, tz), t.state.value, t.reason or "-") for t in job.history]
        lines += ["  " + line for line in table(("TIME", "STATE", "REASON"), rows).splitlines()]
    if result.events:
        lines.append("Device events:")
        rows = [(format_time(e.at, tz), e.kind, e.message) for e in result.events]
        lines += ["  " + line for line in table(("TIME", "KIND", "MESSAGE"), rows).splitlines()]
    return "\n".join(lines)


def _mig_mode(gpu: GpuInfo) -> str:
    current = "on" if gpu.mig_enabled else "off"
    if gpu.mig_pending == gpu.mig_enabled:
        return f"MIG {current}"
    pending = "on" if gpu.mig_pending else "off"
    return f"MIG {current} (pending {pending} after reset)"


def _who(jobs: Sequence[int], users: Sequence[str]) -> str:
    if not jobs:
        return "idle"
    text = ", ".join(str(j) for j in jobs)
    return f"{text} ({', '.join(users)})" if users else text


def gpus_text(result: GpusResult) -> str:
    """`gpusched gpus`: one block per GPU, its MIG instances as a table, or the jobs on the whole GPU."""
    lines = [f"backend {result.backend}, driver {result.driver_version}"]
    if not result.gpus:
        lines.append("No GPUs.")
    for gpu in result.gpus:
        used = f", {format_mib(gpu.memory_used_mib)} used" if gpu.memory_used_mib is not None else ""
        lines.append("")
        lines.append(f"GPU {gpu.index}  {gpu.model}  {gpu.name}  {gpu.uuid}")
        lines.append(
            f"  memory {format_mib(gpu.memory_total_mib)}{used}, {gpu.sm_count} SMs, {_mig_mode(gpu)}, "
            f"share {gpu.share}{', interactive only' if gpu.interactive else ''}, health {gpu.health}"
        )
        if gpu.mig_enabled or gpu.instances:
            if not gpu.instances:
                lines.append("  no MIG instances")
            else:
                rows = [
                    (
                        inst.profile,
                        str(inst.gi_id) if inst.gi_id is not None else "-",
                        f"{inst.start}:{inst.size}",
                        format_mib(inst.memory_mib),
                        str(inst.sm_count),
                        inst.health,
                        inst.uuid,
                        _who(inst.jobs, inst.users),
                    )
                    for inst in sorted(gpu.instances, key=lambda i: (i.start, i.profile))
                ]
                headers = ("PROFILE", "GI", "PLACEMENT", "MEMORY", "SMS", "HEALTH", "UUID", "JOBS")
                lines += ["  " + line for line in table(headers, rows).splitlines()]
        else:
            lines.append(f"  jobs: {_who(gpu.jobs, gpu.users)}")
    return "\n".join(lines)


def cancel_text(result: CancelResult) -> str:
    """What `cancel` did, one line per kind, so a script can still grep for its job ids."""
    lines = [f"Array {a}: its unfinished tasks are cancelled" for a in result.arrays]
    if result.cancelled:
        lines.append("Cancelled job" + ("s " if len(result.cancelled) > 1 else " ") + _ids(result.cancelled))
    if result.already_finished:
        n = len(result.already_finished)
        lines.append(
            ("Jobs " if n > 1 else "Job ")
            + _ids(result.already_finished)
            + " had already finished"
        )
    return "\n".join(lines) or "Nothing to cancel."


def changed_text(done: str, result: JobsChanged) -> str:
    """`Suspended jobs 3, 4` then one line per job left alone, with the daemon's reason."""
    lines = []
    if result.changed:
        lines.append(f"{done} job" + ("s " if len(result.changed) > 1 else " ") + _ids(result.changed))
    lines += [f"Job {job_id} unchanged: {why}" for job_id, why in sorted(result.unchanged.items())]
    return "\n".join(lines) or "Nothing changed."


def _ids(ids: Sequence[int]) -> str:
    if len(ids) > 50:  # a whole array: runs of ids (`124-10123`), not a line of 60 KB
        return compress(sorted(ids)).replace(",", ", ")
    return ", ".join(str(i) for i in ids)


def final_state_text(job: Job) -> str:
    """The line `submit --wait` prints when its job ends: `Job 12 COMPLETED, exit code 0`."""
    detail = _exit_text(job)
    text = f"Job {job.id} {job.state.value}"
    if detail != "-":
        text += f", {detail}"
    # An exit status says it all for jobs that ran to their end; other endings have a reason worth reading.
    if job.reason and (job.state not in (JobState.COMPLETED, JobState.FAILED) or detail == "-"):
        text += f": {job.reason}"
    return text


def doctor_text(result: DoctorResult) -> str:
    """`gpusched doctor`: one line per check, with the fix hint under anything not PASS."""
    lines = []
    width = max((len(c.name) for c in result.checks), default=0)
    for check in result.checks:
        lines.append(f"{check.status:<4}  {check.name.ljust(width)}  {check.detail}")
        if check.hint and check.status != "PASS":
            lines.append(f"      {' ' * width}  fix: {check.hint}")
    counts = {s: sum(1 for c in result.checks if c.status == s) for s in ("PASS", "WARN", "FAIL")}
    lines.append(f"{counts['PASS']} passed, {counts['WARN']} warnings, {counts['FAIL']} failed")
    return "\n".join(lines)


def stats_text(result: StatsResult, tz: tzinfo | None = None) -> str:
    """`gpusched stats`: per-user service and delays (like `perf sched latency`), fairness, device use."""
    span = format_duration(result.now - result.since)
    lines = [f"Window: last {span} (since {format_time(result.since, tz)})", ""]
    rows = [
        (u.user, f"{u.weight:g}", str(u.jobs), f"{u.service_gpu_h:.2f}", f"{u.share:.0%}", f"{u.entitled:.0%}",
         str(u.starts), format_duration(u.wait_avg_s), format_duration(u.wait_max_s),
         format_time(u.wait_max_at, tz))
        for u in result.users
    ]
    if rows:
        lines.append(table(("USER", "WEIGHT", "JOBS", "GPU-H", "SHARE", "ENTITLED", "STARTS", "AVG WAIT",
                            "MAX WAIT", "MAX WAIT AT"), rows))
    else:
        lines.append("No jobs in this window.")
    lines += ["", f"Jain's fairness index (service / entitled share): {result.jain_index:.3f}", ""]
    dev_rows = [(str(d.gpu), d.profile or "whole GPU", d.uuid, f"{d.busy_fraction:.0%}") for d in result.devices]
    lines.append(table(("GPU", "DEVICE", "UUID", "ALLOCATED"), dev_rows))
    return "\n".join(lines)
