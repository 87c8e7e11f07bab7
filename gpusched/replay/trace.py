"""Trace parsers: the generic replay CSV here, the Alibaba GPU v2023 pod lists in alibaba.py, into
`TraceJob`s (tracefile.py).

Both formats end in the same plain records (arrival, duration at the requested size, user, request)
so the simulator and the policies never care where a job came from. Errors are collected, not raised
one at a time, so a user fixing a hand-written trace sees every bad line at once (docs/replay.md).
"""

from __future__ import annotations

import math

from pydantic import ValidationError

from gpusched.model import MigRequest, ShareRequest, WholeRequest
from gpusched.replay.alibaba import (
    ALIBABA_COLUMNS,
    ALIBABA_REQUEST_COLUMNS,
    parse_alibaba,
    user_of,
)
from gpusched.replay.tracefile import (
    MAX_ERRORS,
    Censored,
    FieldError,
    Request,
    RowErrors,
    Trace,
    TraceError,
    TraceFormat,
    TraceJob,
    csv_header,
    number_field,
    offered_demand,
    read_rows,
    scale_to_load,
)

__all__ = [
    "ALIBABA_COLUMNS", "ALIBABA_REQUEST_COLUMNS", "CSV_KINDS", "CSV_OPTIONAL", "CSV_REQUIRED", "MAX_ERRORS",
    "Censored", "FieldError", "Request", "Trace", "TraceError", "TraceFormat", "TraceJob", "detect_format",
    "load_trace", "offered_demand", "parse_alibaba", "parse_csv", "scale_to_load", "user_of",
]

CSV_REQUIRED = ("submit_time", "duration", "user")
CSV_KINDS = ("gpus", "mig", "share")
CSV_OPTIONAL = ("gpu_mem", "class", "weight", "time_limit", "requeue", "precision", "name")


def detect_format(path: str) -> TraceFormat:
    """`alibaba` when the header has the pod-list request columns (times or not), else `csv`.

    The time-less variants (multigpu50) must be recognised too, so that the user is told to give
    --times-from rather than that every generic-CSV column is missing.
    """
    cols = set(csv_header(path))
    return "alibaba" if set(ALIBABA_REQUEST_COLUMNS) <= cols else "csv"


def load_trace(path: str, fmt: str = "auto", *, gpus: int = 8, gpu_memory_mib: int = 81559,
               load: float | None = None, users: int = 16, seed: int = 1, limit: int | None = None,
               times_from: str | None = None, censored: Censored = "keep") -> Trace:
    """Parse `path` in `fmt` (auto|csv|alibaba). Raises TraceError (bad rows), ValueError or OSError.

    `times_from`: an Alibaba pod list with times, for a pod list without them (timesource.py).
    `censored`: what to do with Alibaba pods still running when the trace was taken (parse_alibaba).
    """
    if load is not None and not (math.isfinite(load) and 0 < load <= 10):
        raise ValueError(f"--load must be in (0, 10], not {load}")
    kind = detect_format(path) if fmt == "auto" else fmt
    if kind == "csv":
        if times_from is not None:
            raise ValueError("--times-from is for Alibaba pod lists without time columns, not for a generic CSV")
        if censored != "keep":
            raise ValueError("--censored is for Alibaba pod lists (a generic CSV says nothing of pods still running)")
        trace = parse_csv(path, limit=limit)
        if load is not None:
            trace = scale_to_load(trace, load, gpus)
        return trace
    if kind == "alibaba":
        return parse_alibaba(path, gpus=gpus, gpu_memory_mib=gpu_memory_mib, load=0.9 if load is None else load,
                             users=users, seed=seed, limit=limit, times_from=times_from, censored=censored)
    raise ValueError(f"unknown trace format {fmt!r}; use auto, csv or alibaba")


def parse_csv(path: str, *, limit: int | None = None) -> Trace:
    """The generic format (docs/replay.md): one job per row, errors collected by line and field."""
    errs = RowErrors()
    header = csv_header(path)
    missing = [c for c in CSV_REQUIRED if c not in header]
    for c in missing:
        errs.add(1, c, "required column missing from the header")
    if not any(k in header for k in CSV_KINDS):
        errs.add(1, "gpus|mig|share", "the header needs at least one of the columns gpus, mig, share")
    unknown = [c for c in header if c not in (*CSV_REQUIRED, *CSV_KINDS, *CSV_OPTIONAL)]
    for c in unknown:
        errs.add(1, c, f"unknown column (known: {', '.join((*CSV_REQUIRED, *CSV_KINDS, *CSV_OPTIONAL))})")
    if errs:
        raise TraceError(path, errs.items, more=errs.more)
    jobs: list[TraceJob] = []
    weights: dict[str, tuple[int, int]] = {}  # user -> (weight, line it was first given on)
    for line, row in read_rows(path, limit):
        job = _csv_job(errs, line, row)
        if job is None:
            continue
        if job.weight is not None:
            seen = weights.setdefault(job.user, (job.weight, line))
            if seen[0] != job.weight:
                errs.add(line, "weight", f"user {job.user!r} already has weight {seen[0]} (line {seen[1]})")
                continue
        jobs.append(job)
    if errs:
        raise TraceError(path, errs.items, more=errs.more)
    jobs.sort(key=lambda j: (j.submit_s, j.line))
    return Trace(path, "csv", jobs)


def _csv_job(errs: RowErrors, line: int, row: dict[str, str]) -> TraceJob | None:
    before = len(errs.items) + errs.more
    submit = number_field(errs, line, row, "submit_time")
    duration = number_field(errs, line, row, "duration", strict=True)
    user = row.get("user", "")
    if not user:
        errs.add(line, "user", "missing value")
    kinds = [k for k in CSV_KINDS if row.get(k, "")]
    request: Request | None = None
    if len(kinds) != 1:
        errs.add(line, "gpus|mig|share", "give exactly one of gpus, mig, share"
                 + (f" (got {', '.join(kinds)})" if kinds else ""))
    else:
        request = _csv_request(errs, line, row, kinds[0])
    job_class = row.get("class", "") or "batch"
    if job_class not in ("batch", "interactive"):
        errs.add(line, "class", f"{job_class!r} is not batch or interactive")
    weight: int | None = None
    if row.get("weight", ""):
        w = number_field(errs, line, row, "weight", minimum=1)
        if w is not None and (w != int(w) or w > 10000):
            errs.add(line, "weight", f"{row['weight']} must be a whole number in 1..10000")
        elif w is not None:
            weight = int(w)
    limit = number_field(errs, line, row, "time_limit", strict=True, required=False)
    requeue_text = row.get("requeue", "") or "0"
    if requeue_text not in ("0", "1"):
        errs.add(line, "requeue", f"{requeue_text!r} must be 0 or 1")
    precision = row.get("precision", "") or None
    if precision is not None and precision not in ("fp16", "bf16", "fp32", "tf32"):
        errs.add(line, "precision", f"{precision!r} must be fp16, bf16, fp32 or tf32")
    if len(errs.items) + errs.more > before or submit is None or duration is None or request is None:
        return None
    return TraceJob(
        name=row.get("name", "") or f"line{line}", submit_s=submit, duration_s=duration, user=user,
        request=request, line=line, job_class=job_class,  # type: ignore[arg-type]
        weight=weight, time_limit_s=limit, requeue=requeue_text == "1",
        precision=precision,  # type: ignore[arg-type]
    )


def _csv_request(errs: RowErrors, line: int, row: dict[str, str], kind: str) -> Request | None:
    try:
        if kind == "gpus":
            n = number_field(errs, line, row, "gpus", minimum=1)
            if n is None:
                return None
            if n != int(n):
                errs.add(line, "gpus", f"{row['gpus']} must be a whole number of GPUs")
                return None
            if row.get("gpu_mem", ""):
                errs.add(line, "gpu_mem", "only a share takes gpu_mem (a whole GPU has all its memory)")
                return None
            return WholeRequest(gpus=int(n))
        if kind == "mig":
            if row.get("gpu_mem", ""):
                errs.add(line, "gpu_mem", "only a share takes gpu_mem (a MIG profile names its memory)")
                return None
            return MigRequest(profile=row["mig"])
        frac = number_field(errs, line, row, "share", strict=True)
        mem = number_field(errs, line, row, "gpu_mem", strict=True)
        if frac is None or mem is None:
            return None
        if frac > 1:
            errs.add(line, "share", f"{row['share']} must be at most 1 (use gpus for whole GPUs)")
            return None
        return ShareRequest(fraction=frac, gpu_mem_mib=math.ceil(mem))
    except ValidationError as exc:
        errs.add(line, kind, "; ".join(str(e["msg"]) for e in exc.errors()))
        return None


