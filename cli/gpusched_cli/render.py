"""Human output of the CLI: what each command prints for people. Pure functions of their arguments.

The text primitives (sizes, durations, times, tables, escaping) are in textfmt.py, re-exported here.

Everything a command prints for people is built here from protocol results, so the formats can be
unit-tested without a daemon and the commands stay about talking to one. `now` and the time zone are
arguments for the same reason. Scripts should use `--json`; these formats may change.

Results arrive as the daemon's plain JSON objects (the `--json` shapes); a pydantic result model is
accepted too and read through the same JSON (`results.plain`). This module imports no pydantic: it
is on the path of every command, and the client must start fast.
"""

from __future__ import annotations

import shlex

from gpusched_cli.arrays import array_line, array_ref, array_states, ids_text, job_ref
from gpusched_cli.results import COMPLETED, FAILED, TERMINAL_STATES, WAITING_STATES, plain
from gpusched_cli.textfmt import format_duration as format_duration
from gpusched_cli.textfmt import format_mib as format_mib
from gpusched_cli.textfmt import format_signal as format_signal
from gpusched_cli.textfmt import format_time as format_time
from gpusched_cli.textfmt import printable as printable
from gpusched_cli.textfmt import short_device as short_device
from gpusched_cli.textfmt import table as table

TYPE_CHECKING = False  # typing costs the fast path a few ms to import; mypy reads this as True
if TYPE_CHECKING:  # the models a typed caller may pass instead of plain JSON
    from collections.abc import Mapping, Sequence
    from datetime import tzinfo

    from gpusched.model import Job
    from gpusched.protocol import (
        ArraySummary,
        CancelResult,
        DoctorResult,
        GpusResult,
        JobsChanged,
        JobSummary,
        ShowResult,
        StatsResult,
    )
    from gpusched_cli.results import JSON

# Copied from gpusched.model (which imports pydantic); a test keeps them equal.
MAX_DISPLAY_NAME = 64

def elapsed(job: JobSummary | JSON, now: float) -> float:
    """WAIT/RUNTIME column: waiting time for queued jobs, run time for started ones."""
    row = plain(job)
    started, ended = row.get("started_at"), row.get("ended_at")
    start = float(row["submitted_at"] if started is None else started)
    end = float(ended) if ended is not None else now
    return end - start


QUEUE_HEADERS = ("ID", "NAME", "USER", "STATE", "REQUEST", "DEVICES", "WAIT/RUNTIME", "REASON")


def device_labels(result: GpusResult | JSON) -> dict[str, str]:
    """UUID -> `gpu0` / `gpu1:3g.40gb@4`: what a person can find in `gpusched gpus` at a glance.

    UUIDs are unique but unreadable, and their first digits can be shared (the simulator's are).
    """
    labels: dict[str, str] = {}
    for gpu in plain(result)["gpus"]:
        labels[gpu["uuid"]] = f"gpu{gpu['index']}"
        for inst in gpu["instances"]:
            labels[inst["uuid"]] = f"gpu{gpu['index']}:{inst['profile']}@{inst['start']}"
    return labels


def queue_table(jobs: Sequence[JobSummary | JSON], now: float, labels: Mapping[str, str] | None = None,
                arrays: Sequence[ArraySummary | JSON] = (), *, keep_order: bool = False) -> str:
    """The `gpusched queue` table; says so plainly when there is nothing to show.

    `labels` names devices (see `device_labels`); a device it does not know is shown as a short UUID.
    An array task is named `120_7`; each array is one row (`123_[1-10000%8]`, its tasks counted by
    state), in id order with the jobs. With `keep_order` (`--order fairness`) the jobs stay in the
    order the daemon gave, the order the scheduler would start them, and the arrays follow.
    """
    if not jobs and not arrays:
        return "No jobs."
    names = labels or {}
    rows = [
        (
            int(j["id"]),
            (
                job_ref(j),
                j["name"],
                j["user"],
                j["state"],
                j["request"],
                ",".join(names.get(d) or short_device(d) for d in j["devices"]) or "-",
                format_duration(elapsed(j, now)),
                j["reason"] or "-",
            ),
        )
        for j in map(plain, jobs)
    ]
    rows += [
        (
            int(a["id"]),
            (array_ref(a), a["name"], a["user"], array_states(a), a["request"], "-",
             format_duration(now - a["submitted_at"]), f"pending {a['pending']}" if a.get("pending") else "-"),
        )
        for a in map(plain, arrays)
    ]
    return table(QUEUE_HEADERS, [row for _, row in (rows if keep_order else sorted(rows, key=lambda r: r[0]))])


def _exit_text(job: JSON) -> str:
    parts = []
    if job.get("exit_code") is not None:
        parts.append(f"exit code {job['exit_code']}")
    if job.get("signal") is not None:
        parts.append(f"killed by signal {format_signal(job['signal'])}")
    return ", ".join(parts) or "-"


def display_name(spec: JSON) -> str:
    """As gpusched.model.display_name: `--name`, else the program's base name, at most MAX_DISPLAY_NAME
    characters."""
    text: str = spec.get("name") or spec["argv"][0].rsplit("/", 1)[-1]
    return text if len(text) <= MAX_DISPLAY_NAME else text[: MAX_DISPLAY_NAME - 1] + "\u2026"


def describe_request(request: JSON) -> str:
    """As gpusched.model.describe_request: `gpus=2`, `mig=3g.40gb`, `share=0.25,mem=10240MiB`."""
    if request["kind"] == "whole":
        return f"gpus={request['gpus']}"
    if request["kind"] == "mig":
        return f"mig={request['profile']}"
    if request["kind"] == "partition":
        return f"partition={request['mode'].lower()}" + (f",gpus={request['gpus']}" if request["gpus"] > 1 else "")
    return f"share={request['fraction']:g},mem={request['gpu_mem_mib']}MiB"


def show_text(result: ShowResult | JSON, now: float, tz: tzinfo | None = None) -> str:
    """The `gpusched show` page: what was asked, where the job is, what it got, and how it got there."""
    shown = plain(result)
    job = shown["job"]
    spec = job["spec"]
    state: str = job["state"]
    started, ended = job.get("started_at"), job.get("ended_at")
    time_limit = spec.get("time_limit_s")
    fields: list[tuple[str, str]] = [
        ("user", f"{job['user']} (uid {job['uid']}, gid {job['gid']})"),
        ("command", shlex.join(spec["argv"])),
        ("cwd", spec["cwd"]),
        ("request", describe_request(spec["request"])),
        ("class", f"{spec.get('job_class', 'batch')}, nice {spec.get('nice', 0)}"),
        ("time limit", format_duration(time_limit) if time_limit else "none"),
        ("requeue", "yes" if spec.get("requeue") else "no"),
        ("precision", spec.get("precision") or "any"),
        ("submitted", format_time(job["submitted_at"], tz)),
    ]
    if started is not None:
        fields.append(("started", format_time(started, tz)))
    if ended is not None:
        fields.append(("ended", format_time(ended, tz)))
    if started is not None:
        end = ended if ended is not None else now
        fields.append(("runtime", format_duration(end - started)))
    elif state in WAITING_STATES:
        fields.append(("waiting", format_duration(now - job["submitted_at"])))
    if state in TERMINAL_STATES or job.get("exit_code") is not None or job.get("signal") is not None:
        fields.append(("result", _exit_text(job)))
    if job.get("reason"):
        fields.append(("reason", job["reason"]))
    if shown.get("waiting_reason"):
        fields.append(("waiting for", shown["waiting_reason"]))
    est = shown.get("estimate")
    if est is not None:
        runtime_s = est["runtime_s"]
        length = format_duration(runtime_s) if runtime_s >= 1 else f"{runtime_s:.1f} s"
        fields.append(("estimate", f"{length} ({est['source']})"))
        start_at, end_at = est.get("expected_start_at"), est.get("expected_end_at")
        if start_at is not None:
            fields.append(("est. start", f"{format_time(start_at, tz)} "
                                         f"(in {format_duration(max(0.0, start_at - now))})"))
        elif state in WAITING_STATES:
            # A job waiting for others (--after, an array's %MAX) is not in the scheduler's queue yet:
            # it says so above.
            waits_for_others = (shown.get("waiting_reason") or "").startswith(("waiting for job ",
                                                                                 "waiting for array "))
            fields.append(("est. start", "unknown (once what it waits for has ended)" if waits_for_others
                           else "unknown (needs a MIG change, or too many jobs ahead)"))
        if end_at is not None:
            fields.append(("est. end", f"{format_time(end_at, tz)} "
                                       f"(in {format_duration(max(0.0, end_at - now))})"))
    alloc = job.get("allocation")
    if alloc is not None:
        for i, dev in enumerate(alloc["devices"]):
            what = f"GPU {dev['gpu_index']}" + (f", MIG {dev['profile']}" if dev.get("profile") else "")
            fields.append(("devices" if i == 0 else "", f"{dev['uuid']} ({what})"))
        if alloc.get("share") is not None:
            fields.append(("share", f"{alloc['share']:g} of the device's compute"))
        if alloc.get("gpu_mem_mib") is not None:
            fields.append(("memory cap", format_mib(alloc["gpu_mem_mib"])))
        for i, (key, value) in enumerate(sorted(alloc.get("env", {}).items())):
            fields.append(("env added" if i == 0 else "", f"{key}={value}"))
    if job.get("pid") is not None:
        fields.append(("pid", str(job["pid"])))
    fields.append(("log", shown.get("log_path") or "-"))

    array = shown.get("array")
    if array is not None:
        fields.insert(0, ("array", array_line(job, array)))
    width = max(len(k) for k, _ in fields)
    title = f"Job {job['id']}" + (f" = {job_ref(job)}" if job.get("array_id") is not None else "")
    lines = [f"{title} ({printable(display_name(spec), one_line=True)})  {state}"]
    lines += [f"  {k.ljust(width)}  {printable(v, one_line=True)}" for k, v in fields]
    if job.get("history"):
        lines.append("History:")
        rows = [(format_time(t["at"], tz), t["state"], t["reason"] or "-") for t in job["history"]]
        lines += ["  " + line for line in table(("TIME", "STATE", "REASON"), rows).splitlines()]
    if shown.get("events"):
        lines.append("Device events:")
        rows = [(format_time(e["at"], tz), e["kind"], e["message"]) for e in shown["events"]]
        lines += ["  " + line for line in table(("TIME", "KIND", "MESSAGE"), rows).splitlines()]
    return "\n".join(lines)


def _mig_mode(gpu: JSON) -> str:
    current = "on" if gpu["mig_enabled"] else "off"
    if gpu["mig_pending"] == gpu["mig_enabled"]:
        return f"MIG {current}"
    pending = "on" if gpu["mig_pending"] else "off"
    return f"MIG {current} (pending {pending} after reset)"


def _who(jobs: Sequence[int], users: Sequence[str]) -> str:
    if not jobs:
        return "idle"
    text = ", ".join(str(j) for j in jobs)
    return f"{text} ({', '.join(users)})" if users else text


def gpus_text(result: GpusResult | JSON) -> str:
    """`gpusched gpus`: one block per GPU, its MIG instances as a table, or the jobs on the whole GPU."""
    shown = plain(result)
    lines = [f"backend {shown['backend']}, driver {shown['driver_version']}"]
    if not shown["gpus"]:
        lines.append("No GPUs.")
    for gpu in shown["gpus"]:
        used_mib = gpu.get("memory_used_mib")
        used = f", {format_mib(used_mib)} used" if used_mib is not None else ""
        instances = gpu["instances"]
        lines.append("")
        lines.append(f"GPU {gpu['index']}  {gpu['model']}  {gpu['name']}  {gpu['uuid']}")
        part = gpu.get("partition")
        if part:  # an AMD logical GPU: which physical GPU, in which modes
            lines.append(f"  partition {part['index_in_physical']} of {part['count']} on physical GPU "
                         f"{part['physical_index']}, {part['compute_mode']}/{part['memory_mode']}")
        amd = gpu.get("vendor") == "amd"
        lines.append(
            f"  memory {format_mib(gpu['memory_total_mib'])}{used}, {gpu['sm_count']} {'CUs' if amd else 'SMs'}, "
            f"{'no MIG (AMD)' if amd else _mig_mode(gpu)}, "
            f"share {gpu.get('share', 'exclusive')}{', interactive only' if gpu.get('interactive') else ''}, "
            f"health {gpu['health']}"
        )
        if gpu["mig_enabled"] or instances:
            if not instances:
                lines.append("  no MIG instances")
            else:
                rows = [
                    (
                        inst["profile"],
                        str(inst["gi_id"]) if inst.get("gi_id") is not None else "-",
                        f"{inst['start']}:{inst['size']}",
                        format_mib(inst["memory_mib"]),
                        str(inst["sm_count"]),
                        inst["health"],
                        inst["uuid"],
                        _who(inst["jobs"], inst["users"]),
                    )
                    for inst in sorted(instances, key=lambda i: (i["start"], i["profile"]))
                ]
                headers = ("PROFILE", "GI", "PLACEMENT", "MEMORY", "SMS", "HEALTH", "UUID", "JOBS")
                lines += ["  " + line for line in table(headers, rows).splitlines()]
        else:
            lines.append(f"  jobs: {_who(gpu['jobs'], gpu['users'])}")
    return "\n".join(lines)


def cancel_text(result: CancelResult | JSON) -> str:
    """What `cancel` did, one line per kind, so a script can still grep for its job ids."""
    shown = plain(result)
    cancelled, finished = shown["cancelled"], shown.get("already_finished", [])
    lines = [f"Array {a}: its unfinished tasks are cancelled" for a in shown.get("arrays", [])]
    if cancelled:
        lines.append("Cancelled job" + ("s " if len(cancelled) > 1 else " ") + ids_text(cancelled))
    if finished:
        n = len(finished)
        lines.append(
            ("Jobs " if n > 1 else "Job ")
            + ids_text(finished)
            + " had already finished"
        )
    return "\n".join(lines) or "Nothing to cancel."


def changed_text(done: str, result: JobsChanged | JSON) -> str:
    """`Suspended jobs 3, 4` then one line per job left alone, with the daemon's reason."""
    shown = plain(result)
    changed = shown["changed"]
    # JSON object keys are strings: order them as the job ids they are.
    unchanged = sorted(shown.get("unchanged", {}).items(), key=lambda item: int(item[0]))
    lines = [f"Array {a}: its tasks that could be are {done.lower()}, the others are left as they are"
             for a in shown.get("arrays", [])]
    if changed:
        lines.append(f"{done} job" + ("s " if len(changed) > 1 else " ") + ids_text(changed))
    lines += [f"Job {job_id} unchanged: {why}" for job_id, why in unchanged]
    return "\n".join(lines) or "Nothing changed."


def final_state_text(job: Job | JSON) -> str:
    """The line `submit --wait` prints when its job ends: `Job 12 COMPLETED, exit code 0`."""
    shown = plain(job)
    detail = _exit_text(shown)
    text = f"Job {shown['id']} {shown['state']}"
    if detail != "-":
        text += f", {detail}"
    # An exit status says it all for jobs that ran to their end; other endings have a reason worth
    # reading, and so does a FAILED job whose program exited 0 (the daemon stopped it: a GPU fault).
    failed_by_daemon = shown["state"] == FAILED and shown.get("exit_code") == 0
    if shown.get("reason") and (shown["state"] not in (COMPLETED, FAILED) or detail == "-" or failed_by_daemon):
        text += f": {shown['reason']}"
    return text


def doctor_text(result: DoctorResult | JSON) -> str:
    """`gpusched doctor`: one line per check, with the fix hint under anything not PASS."""
    checks = plain(result)["checks"]
    lines = []
    width = max((len(c["name"]) for c in checks), default=0)
    for check in checks:
        lines.append(f"{check['status']:<4}  {check['name'].ljust(width)}  {check['detail']}")
        if check.get("hint") and check["status"] != "PASS":
            lines.append(f"      {' ' * width}  fix: {check['hint']}")
    counts = {s: sum(1 for c in checks if c["status"] == s) for s in ("PASS", "WARN", "FAIL")}
    lines.append(f"{counts['PASS']} passed, {counts['WARN']} warnings, {counts['FAIL']} failed")
    return "\n".join(lines)


def stats_text(result: StatsResult | JSON, tz: tzinfo | None = None) -> str:
    """`gpusched stats`: per-user service and delays (like `perf sched latency`), fairness, device use."""
    shown = plain(result)
    span = format_duration(shown["now"] - shown["since"])
    lines = [f"Window: last {span} (since {format_time(shown['since'], tz)})", ""]
    rows = [
        (u["user"], f"{u['weight']:g}", str(u["jobs"]), f"{u['service_gpu_h']:.2f}", f"{u['share']:.0%}",
         f"{u['entitled']:.0%}", str(u["starts"]), format_duration(u["wait_avg_s"]),
         format_duration(u["wait_max_s"]), format_time(u["wait_max_at"], tz))
        for u in shown["users"]
    ]
    if rows:
        lines.append(table(("USER", "WEIGHT", "JOBS", "GPU-H", "SHARE", "ENTITLED", "STARTS", "AVG WAIT",
                            "MAX WAIT", "MAX WAIT AT"), rows))
    else:
        lines.append("No jobs in this window.")
    lines += ["", f"Jain's fairness index (service / entitled share): {shown['jain_index']:.3f}", ""]
    dev_rows = [(str(d["gpu"]), d["profile"] or "whole GPU", d["uuid"], f"{d['busy_fraction']:.0%}")
                for d in shown["devices"]]
    lines.append(table(("GPU", "DEVICE", "UUID", "ALLOCATED"), dev_rows))
    return "\n".join(lines)
