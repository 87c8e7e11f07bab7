"""What every trace parser produces and shares: `TraceJob`, `Trace`, errors by line and field, the
row reader and error collector, and the rescaling of arrivals to an offered load.

Kept apart from the parsers (trace.py, alibaba.py) so both formats build the same records the
simulator and the policies read, without importing each other.
"""

from __future__ import annotations

import csv
import math
import os
import stat
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import IO, Literal

from gpusched.model import MigRequest, ShareRequest, WholeRequest

Request = WholeRequest | MigRequest | ShareRequest
TraceFormat = Literal["csv", "alibaba"]
Censored = Literal["keep", "drop"]  # pods still running when the Alibaba trace was taken (alibaba.py)

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
    load_ignored: str | None = None  # why --load could not be applied (the text output says so)
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


MAX_LINE_CHARS = 1 << 16  # a trace row is a few hundred characters; /dev/zero is one endless line


@contextmanager
def csv_lines(path: str) -> Iterator[Iterator[str]]:
    """The lines of a trace or pod list for `csv`: a regular file only (a device or a FIFO never ends),
    read as UTF-8 (a byte-order mark is dropped), no line longer than MAX_LINE_CHARS. Anything else
    is a ValueError naming the file and the line, never a traceback or a read without end."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # (opening a FIFO must not block)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path}: not a regular file")
        os.set_blocking(fd, True)
        fh = open(fd, newline="", encoding="utf-8-sig", closefd=False)  # noqa: SIM115 - closed below
    except BaseException:
        os.close(fd)
        raise
    try:
        yield _bounded(fh, path)
    except csv.Error as exc:
        raise ValueError(f"{path}: not a readable CSV file: {exc}") from None
    finally:
        fh.close()
        os.close(fd)


def _bounded(fh: IO[str], path: str) -> Iterator[str]:
    number = 0
    while True:
        try:
            line = fh.readline(MAX_LINE_CHARS + 1)
        except UnicodeDecodeError:  # (decoded a block at a time: the bad byte is on this line or a later one)
            raise ValueError(f"{path}: not valid UTF-8 at or after line {number + 1}") from None
        if not line:
            return
        number += 1
        if len(line) > MAX_LINE_CHARS:
            raise ValueError(f"{path}: line {number} is longer than {MAX_LINE_CHARS} characters; is it a trace?")
        yield line


def csv_header(path: str) -> list[str]:
    """The header row's columns, stripped (empty for an empty file)."""
    with csv_lines(path) as lines:
        return [c.strip() for c in next(csv.reader(lines), [])]


def read_rows(path: str, limit: int | None) -> Iterator[tuple[int, dict[str, str]]]:
    with csv_lines(path) as lines:
        reader = csv.DictReader(lines)
        if reader.fieldnames is None:
            return
        columns = reader.fieldnames = [f.strip() for f in reader.fieldnames]
        twice = sorted({c for c in columns if columns.count(c) > 1})
        if twice:  # (DictReader would keep the last one's values without a word)
            raise TraceError(path, [FieldError(1, c, "column named twice in the header") for c in twice])
        for n, row in enumerate(reader):
            if limit is not None and n >= limit:
                return
            if None in row:  # (DictReader would drop them without a word)
                cells = len(columns) + len(row[None])
                raise TraceError(path, [FieldError(reader.line_num, "(row)",
                                                   f"{cells} cells, the header has {len(columns)} columns")])
            yield reader.line_num, {k: (v or "").strip() for k, v in row.items()}


class RowErrors:
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


def number_field(errs: RowErrors, line: int, row: dict[str, str], name: str, *, minimum: float = 0.0,
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


def offered_demand(jobs: Iterable[TraceJob]) -> float:
    """GPU-seconds the jobs ask for at their requested sizes."""
    return sum(j.gpu_demand * j.duration_s for j in jobs)


def scale_to_load(trace: Trace, load: float, gpus: int) -> Trace:
    """Stretch or compress arrival times so offered demand / (gpus x arrival span) = `load`.

    The Alibaba trace comes from a ~6,000-GPU cluster; replaying it on one node at its own arrival
    rate would be meaningless, so the arrival span is rescaled (durations are kept).
    """
    if len(trace.jobs) < 2:
        return replace(trace, load_ignored="the trace has fewer than two jobs")
    t0 = trace.jobs[0].submit_s
    span = trace.jobs[-1].submit_s - t0
    demand = offered_demand(trace.jobs)
    if span <= 0:
        return replace(trace, load_ignored="every job arrives at the same time: there are no arrival times to scale")
    if demand <= 0:
        return replace(trace, load_ignored="the trace's jobs ask for no GPU time")
    scale = demand / (gpus * load) / span
    jobs = [_moved(j, t0 + (j.submit_s - t0) * scale) for j in trace.jobs]
    return replace(trace, jobs=jobs, time_scale=trace.time_scale * scale)


def _moved(job: TraceJob, submit: float) -> TraceJob:
    return replace(job, submit_s=submit)
