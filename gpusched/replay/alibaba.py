"""The Alibaba GPU v2023 pod lists (`openb_pod_list_*.csv`) as replay jobs (mapping in docs/replay.md).

Pods become whole-GPU jobs or shares, tenants are drawn by a hash of pod name and seed (the trace has
no user column), time-less variants borrow their times (timesource.py), and pods still running when
the trace was taken can be left out (`censored`).
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter

from pydantic import ValidationError

from gpusched.model import ShareRequest, WholeRequest
from gpusched.replay.timesource import TIME_COLUMNS, finite_number, load_time_source
from gpusched.replay.tracefile import (
    Censored,
    Request,
    RowErrors,
    Trace,
    TraceError,
    TraceJob,
    csv_header,
    number_field,
    read_rows,
    scale_to_load,
)

ALIBABA_COLUMNS = ("name", "num_gpu", "gpu_milli", "creation_time", "deletion_time", "scheduled_time")
ALIBABA_REQUEST_COLUMNS = ("num_gpu", "gpu_milli")  # enough to recognise a pod list, with or without times


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
    errs = RowErrors()
    header = csv_header(path)
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
    for line, row in read_rows(path, limit):
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


def _alibaba_job(errs: RowErrors, skipped: Counter[str], line: int, row: dict[str, str], mem_total: int,
                 users: int, seed: int) -> TraceJob | None:
    before = len(errs.items) + errs.more
    num_gpu = number_field(errs, line, row, "num_gpu")
    milli = number_field(errs, line, row, "gpu_milli")
    created = number_field(errs, line, row, "creation_time")
    if len(errs.items) + errs.more > before or num_gpu is None or milli is None or created is None:
        return None
    if num_gpu == 0:
        skipped["no GPU"] += 1
        return None
    if not row.get("scheduled_time", ""):
        skipped["never scheduled"] += 1
        return None
    scheduled = number_field(errs, line, row, "scheduled_time")
    deleted = number_field(errs, line, row, "deletion_time")
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
        try:
            request = WholeRequest(gpus=int(num_gpu))
        except ValidationError as exc:
            errs.add(line, "num_gpu", "; ".join(str(e["msg"]) for e in exc.errors()))
            return None
    elif num_gpu == 1 and milli > 0:
        frac = milli / 1000
        request = ShareRequest(fraction=frac, gpu_mem_mib=max(1, math.ceil(frac * mem_total)))
    else:
        errs.add(line, "gpu_milli", f"{row['gpu_milli']} with num_gpu={row['num_gpu']}: a fraction needs num_gpu=1")
        return None
    name = row.get("name", "") or f"line{line}"
    return TraceJob(name=name, submit_s=created, duration_s=duration, user=user_of(name, users, seed),
                    request=request, line=line, flexible=isinstance(request, ShareRequest))


