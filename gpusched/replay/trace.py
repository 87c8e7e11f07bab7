"""Trace parsers: the generic replay CSV and the Alibaba GPU v2023 pod lists, into `TraceJob`s.

Both formats end in the same plain records (arrival, duration at the requested size, user, request)
so the simulator and the policies never care where a job came from. Errors are collected, not raised
one at a time, so a user fixing a hand-written trace sees every bad line at once (docs/replay.md).
"""

from __future__ import annotations

import csv
import hashlib
import math
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Literal

from pydantic import ValidationError

from gpusched.model import MigRequest, ShareRequest, WholeRequest
from gpusched.replay.timesource import TIME_COLUMNS, finite_number, load_time_source

Request = WholeRequest | MigRequest | ShareRequest
TraceFormat = Literal["csv", "alibaba"]
Censored = Literal["keep", "drop"]  # pods still running when the Alibaba trace was taken (parse_alibaba)

CSV_REQUIRED = ("submit_time", "duration", "user")
CSV_KINDS = ("gpus", "mig", "share")
CSV_OPTIONAL = ("gpu_mem", "class", "weight", "time_limit", "requeue", "precision", "name")
ALIBABA_COLUMNS = ("name", "num_gpu", "gpu_milli", "creation_time", "deletion_time", "scheduled_time")
ALIBABA_REQUEST_COLUMNS = ("num_gpu", "gpu_milli")  # enough to recognise a pod list, with or without times
MAX_ERRORS = 50  # a trace with more bad rows is reported by its first 50


@dataclass(frozen=True, slots=True)
class FieldError:
    """One bad value: where (1-based line of the file, header = line 1) and which column."""

    line: int
    field: str
    message: str

    def __str__(self) -> str:
        return f"line {self.line}, field {self.field!r}: {self.message}"


class TraceError(Exception):
    """The trace cannot be replayed; `errors` lists every bad line and field found."""

    def __init__(self, path: str, errors: list[FieldError], *, more: int = 0) -> None:
        self.path = path
        self.errors = errors
        self.more = more
        lines = [f"{path}: {e}" for e in errors]
        if more:
            lines.append(f"{path}: ... and {more} more errors")
        super().__init__("\n".join(lines) if lines else f"{path}: bad trace")


@dataclass(frozen=True, slots=True)
class TraceJob:
    """One job to replay. `duration_s` is its run time when it gets exactly what it asked for.

    `flexible` marks a share that came from a fractional Alibaba pod: the gpusched policy may serve
    it with a MIG profile instead (policies.py), because the pod asked for "a fraction of a GPU",
    not for MPS specifically.
    """

    name: str
    submit_s: float
    duration_s: float
    user: str
    request: Request
    line: int
    job_class: Literal["batch", "interactive"] = "batch"
    weight: int | None = None
    time_limit_s: float | None = None
    requeue: bool = False
    precision: Literal["fp16", "bf16", "fp32", "tf32"] | None = None
    flexible: bool = False

    @property
    def gpu_demand(self) -> float:
        """GPUs' worth of compute this job asks for (whole N -> N, share f -> f, MIG -> 1/7 per slice)."""
        req = self.request
        if isinstance(req, WholeRequest):
            return float(req.gpus)
        if isinstance(req, ShareRequest):
            return req.fraction
        return int(req.profile.split("g", 1)[0]) / 7


@dataclass(slots=True)
class Trace:
    """Parsed jobs in submission order, plus what was left out and why."""

    path: str
    format: TraceFormat
    jobs: list[TraceJob]
    skipped: Counter[str] = field(default_factory=Counter)  # reason -> rows
    time_scale: float = 1.0  # arrival times were multiplied by this (--load)
    times_from: str | None = None  # pod list the arrival and run times were borrowed from (--times-from)
    times_matched: int = 0  # rows that took the times of the pod of the same name there
    times_drawn: int = 0  # rows with no such pod, given the times of a pod drawn by hash

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())

    def weights(self) -> dict[str, int]:
        """User -> weight given in the trace (CSV `weight` column)."""
        return {j.user: j.weight for j in self.jobs if j.weight is not None}

    def users(self) -> list[str]:
        return sorted({j.user for j in self.jobs})


def detect_format(path: str) -> TraceFormat:
    """`alibaba` when the header has the pod-list request columns (times or not), else `csv`.

    The time-less variants (multigpu50) must be recognised too, so that the user is told to give
    --times-from rather than that every generic-CSV column is missing.
    """
    with open(path, newline="", encoding="utf-8") as fh:
        header = next(csv.reader(fh), [])
    cols = {c.strip() for c in header}
    return "alibaba" if set(ALIBABA_REQUEST_COLUMNS) <= cols else "csv"


def load_trace(path: str, fmt: str = "auto", *, gpus: int = 8, gpu_memory_mib: int = 81559,
               load: float | None = None, users: int = 16, seed: int = 1, limit: int | None = None,
               times_from: str | None = None, censored: Censored = "keep") -> Trace:
    """Parse `path` in `fmt` (auto|csv|alibaba). Raises TraceError (bad rows), ValueError or OSError.

    `times_from`: an Alibaba pod list with times, for a pod list without them (timesource.py).
    `censored`: what to do with Alibaba pods still running when the trace was taken (parse_alibaba).
    """
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


# ---- generic CSV ------------------------------------------------------------------------------

def _rows(path: str, limit: int | None) -> Iterator[tuple[int, dict[str, str]]]:
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        if reader.fieldnames is None:
            return
        reader.fieldnames = [f.strip() for f in reader.fieldnames]
        for n, row in enumerate(reader):
            if limit is not None and n >= limit:
                return
            yield reader.line_num, {k: (v or "").strip() for k, v in row.items() if k is not None}


class _Errors:
    """Collects FieldErrors up to MAX_ERRORS and counts the rest."""

    def __init__(self) -> None:
        self.items: list[FieldError] = []
        self.more = 0

    def add(self, line: int, name: str, message: str) -> None:
        if len(self.items) < MAX_ERRORS:
            self.items.append(FieldError(line, name, message))
        else:
            self.more += 1

    def __bool__(self) -> bool:
        return bool(self.items)


def _num(errs: _Errors, line: int, row: dict[str, str], name: str, *, minimum: float = 0.0,
         strict: bool = False, required: bool = True) -> float | None:
    text = row.get(name, "")
    if text == "":
        if required:
            errs.add(line, name, "missing value")
        return None
    try:
        value = float(text)
    except ValueError:
        errs.add(line, name, f"{text!r} is not a number")
        return None
    if not math.isfinite(value) or value < minimum or (strict and value <= minimum):
        errs.add(line, name, f"{text} must be {'>' if strict else '>='} {minimum:g}")
        return None
    return value


def parse_csv(path: str, *, limit: int | None = None) -> Trace:
    """The generic format (docs/replay.md): one job per row, errors collected by line and field."""
    errs = _Errors()
    with open(path, newline="", encoding="utf-8") as fh:
        header = [c.strip() for c in next(csv.reader(fh), [])]
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
    for line, row in _rows(path, limit):
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


def _csv_job(errs: _Errors, line: int, row: dict[str, str]) -> TraceJob | None:
    before = len(errs.items) + errs.more
    submit = _num(errs, line, row, "submit_time")
    duration = _num(errs, line, row, "duration", strict=True)
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
        w = _num(errs, line, row, "weight", minimum=1)
        if w is not None and (w != int(w) or w > 10000):
            errs.add(line, "weight", f"{row['weight']} must be a whole number in 1..10000")
        elif w is not None:
            weight = int(w)
    limit = _num(errs, line, row, "time_limit", strict=True, required=False)
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


def _csv_request(errs: _Errors, line: int, row: dict[str, str], kind: str) -> Request | None:
    try:
        if kind == "gpus":
            n = _num(errs, line, row, "gpus", minimum=1)
            if n is None:
                return None
            if n != int(n):
                errs.add(line, "gpus", f"{row['gpus']} must be a whole number of GPUs")
                return None
            return WholeRequest(gpus=int(n))
        if kind == "mig":
            if row.get("gpu_mem", ""):
                errs.add(line, "gpu_mem", "only a share takes gpu_mem (a MIG profile names its memory)")
                return None
            return MigRequest(profile=row["mig"])
        frac = _num(errs, line, row, "share", strict=True)
        mem = _num(errs, line, row, "gpu_mem", strict=True)
        if frac is None or mem is None:
            return None
        if frac > 1:
            errs.add(line, "share", f"{row['share']} must be at most 1 (use gpus for whole GPUs)")
            return None
        return ShareRequest(fraction=frac, gpu_mem_mib=math.ceil(mem))
    except ValidationError as exc:
        errs.add(line, kind, "; ".join(str(e["msg"]) for e in exc.errors()))
        return None


# ---- Alibaba GPU v2023 ------------------------------------------------------------------------

def user_of(name: str, users: int, seed: int) -> str:
    """Deterministic stand-in tenant (the trace has no user column): hash of seed and pod name."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return f"u{int.from_bytes(digest, 'big') % users:02d}"


def parse_alibaba(path: str, *, gpus: int, gpu_memory_mib: int, load: float = 0.9, users: int = 16,
                  seed: int = 1, limit: int | None = None, times_from: str | None = None,
                  censored: Censored = "keep") -> Trace:
    """Alibaba `openb_pod_list_*.csv` -> jobs (mapping in docs/replay.md).

    num_gpu >= 1 with gpu_milli = 1000 -> N whole GPUs; num_gpu == 1 with gpu_milli < 1000 -> a share
    of gpu_milli/1000 with that fraction of `gpu_memory_mib`; duration = deletion - scheduled time.
    Pods never scheduled, without GPUs, or with no positive duration are skipped and counted.
    A pod list without time columns needs `times_from` (timesource.py): each row then takes the
    times of the pod of the same name there, or of one drawn by a hash of seed and name.

    A pod whose deletion_time is the last one in its file (the time the trace was taken) was still
    running then: its duration is a lower bound, not a run time. Most are long-lived services, few
    but heavy (23 pods and 76 % of the requested GPU-seconds of gpushare100). `censored="drop"`
    leaves them out (counted as skipped) before arrivals are scaled to `load`; "keep" replays them
    as jobs that end at the trace's end, as before.
    """
    if censored not in ("keep", "drop"):
        raise ValueError(f"--censored must be keep or drop, not {censored!r}")
    if users < 1:
        raise ValueError("--users must be at least 1")
    if not 0 < load <= 10:
        raise ValueError("--load must be in (0, 10]")
    errs = _Errors()
    with open(path, newline="", encoding="utf-8") as fh:
        header = [c.strip() for c in next(csv.reader(fh), [])]
    own_times = [c for c in TIME_COLUMNS if c in header]
    if times_from is not None and own_times:
        raise ValueError(f"{path} has its own time columns ({', '.join(own_times)}); --times-from is only for "
                         "pod lists without them")
    timeless = not own_times
    for c in ALIBABA_COLUMNS:
        if c not in header and not (c in TIME_COLUMNS and (timeless or times_from is not None)):
            errs.add(1, c, "Alibaba pod-list column missing from the header")
    if timeless and times_from is None:
        errs.add(1, "|".join(TIME_COLUMNS), "no time columns in the header, so no arrival or run times: take them "
                 "from a pod list with the same pod names (e.g. openb_pod_list_default.csv) with --times-from PATH")
    if errs:
        raise TraceError(path, errs.items, more=errs.more)
    source = load_time_source(times_from) if times_from is not None else None
    skipped: Counter[str] = Counter()
    jobs: list[TraceJob] = []
    deleted_at: dict[int, float] = {}  # job line -> its deletion time, to find the censored ones
    last_deletion = source.last_deletion if source is not None else -math.inf
    matched = drawn = 0
    for line, row in _rows(path, limit):
        if source is not None:
            row, by_name = source.fill(row, f"line{line}", seed)
            matched += by_name
            drawn += not by_name
        deleted = finite_number(row.get("deletion_time", ""))  # a bad one is reported by _alibaba_job
        if deleted is not None and source is None:
            last_deletion = max(last_deletion, deleted)
        job = _alibaba_job(errs, skipped, line, row, gpu_memory_mib, users, seed)
        if job is not None:
            jobs.append(job)
            if deleted is not None:
                deleted_at[job.line] = deleted
    if errs:
        raise TraceError(path, errs.items, more=errs.more)
    if censored == "drop":
        kept = [j for j in jobs if deleted_at.get(j.line) != last_deletion]
        if len(kept) < len(jobs):
            skipped["still running when the trace was taken (--censored drop)"] += len(jobs) - len(kept)
        jobs = kept
    jobs.sort(key=lambda j: (j.submit_s, j.line))
    trace = Trace(path, "alibaba", jobs, skipped, times_from=times_from, times_matched=matched, times_drawn=drawn)
    return scale_to_load(trace, load, gpus)


def _alibaba_job(errs: _Errors, skipped: Counter[str], line: int, row: dict[str, str], mem_total: int,
                 users: int, seed: int) -> TraceJob | None:
    before = len(errs.items) + errs.more
    num_gpu = _num(errs, line, row, "num_gpu")
    milli = _num(errs, line, row, "gpu_milli")
    created = _num(errs, line, row, "creation_time")
    if len(errs.items) + errs.more > before or num_gpu is None or milli is None or created is None:
        return None
    if num_gpu == 0:
        skipped["no GPU"] += 1
        return None
    if not row.get("scheduled_time", ""):
        skipped["never scheduled"] += 1
        return None
    scheduled = _num(errs, line, row, "scheduled_time")
    deleted = _num(errs, line, row, "deletion_time")
    if scheduled is None or deleted is None:
        return None
    duration = deleted - scheduled
    if duration <= 0:
        skipped["no positive duration"] += 1
        return None
    request: Request
    if num_gpu != int(num_gpu):
        errs.add(line, "num_gpu", f"{row['num_gpu']} is not a whole number")
        return None
    if milli >= 1000:
        request = WholeRequest(gpus=int(num_gpu))
    elif num_gpu == 1 and milli > 0:
        frac = milli / 1000
        request = ShareRequest(fraction=frac, gpu_mem_mib=max(1, math.ceil(frac * mem_total)))
    else:
        errs.add(line, "gpu_milli", f"{row['gpu_milli']} with num_gpu={row['num_gpu']}: a fraction needs num_gpu=1")
        return None
    name = row.get("name", "") or f"line{line}"
    return TraceJob(name=name, submit_s=created, duration_s=duration, user=user_of(name, users, seed),
                    request=request, line=line, flexible=isinstance(request, ShareRequest))


def offered_demand(jobs: Iterable[TraceJob]) -> float:
    """GPU-seconds the jobs ask for at their requested sizes."""
    return sum(j.gpu_demand * j.duration_s for j in jobs)


def scale_to_load(trace: Trace, load: float, gpus: int) -> Trace:
    """Stretch or compress arrival times so offered demand / (gpus x arrival span) = `load`.

    The Alibaba trace comes from a ~6,000-GPU cluster; replaying it on one node at its own arrival
    rate would be meaningless, so the arrival span is rescaled (durations are kept).
    """
    if len(trace.jobs) < 2:
        return trace
    t0 = trace.jobs[0].submit_s
    span = trace.jobs[-1].submit_s - t0
    demand = offered_demand(trace.jobs)
    if span <= 0 or demand <= 0:
        return trace
    scale = demand / (gpus * load) / span
    jobs = [_moved(j, t0 + (j.submit_s - t0) * scale) for j in trace.jobs]
    return replace(trace, jobs=jobs, time_scale=trace.time_scale * scale)


def _moved(job: TraceJob, submit: float) -> TraceJob:
    return replace(job, submit_s=submit)
