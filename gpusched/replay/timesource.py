"""Arrival and run times borrowed from another Alibaba pod list (`gpusched replay --times-from`).

Some Alibaba v2023 workload variants (`openb_pod_list_multigpu50.csv`) carry only the requests
(`name, cpu_milli, memory_mib, num_gpu, gpu_milli`), no creation, scheduling or deletion times. They
were built from the same production trace as the default pod list, so a pod whose name appears in
that list takes its times from there; a pod the list lacks takes the times of one of the list's
replayable pods, drawn by a hash of seed and name so that every run and every policy sees the same
trace. docs/replay.md says what we found when comparing the files.
"""

from __future__ import annotations

import csv
import hashlib
import math
from dataclasses import dataclass

from gpusched.replay.tracefile import csv_lines

TIME_COLUMNS: tuple[str, ...] = ("creation_time", "scheduled_time", "deletion_time")
MAX_ERRORS = 50


class TimeSourceError(ValueError):
    """The pod list given to --times-from is unusable; the message names the file, line and field."""


@dataclass(frozen=True, slots=True)
class TimeSource:
    """Times by pod name, and the pool (file order) that pods without a match are drawn from.

    Values are kept as the file's strings so a borrowed row is parsed exactly like a native one.
    """

    path: str
    by_name: dict[str, dict[str, str]]
    pool: tuple[dict[str, str], ...]  # replayable rows: GPU pods, scheduled, positive duration
    last_deletion: float = -math.inf  # the file's last deletion_time: when its trace was taken

    def times_for(self, name: str, seed: int) -> tuple[dict[str, str], bool]:
        """(the three time columns for pod `name`, whether they came from a pod of that name)."""
        found = self.by_name.get(name)
        if found is not None:
            return found, True
        # A domain tag keeps this draw independent of user_of(), which hashes the same seed and name.
        digest = hashlib.blake2b(f"times:{seed}:{name}".encode(), digest_size=8).digest()
        return self.pool[int.from_bytes(digest, "big") % len(self.pool)], False

    def fill(self, row: dict[str, str], default_name: str, seed: int) -> tuple[dict[str, str], bool]:
        """`row` with its time columns taken from its namesake (or a drawn pod); True when by name."""
        times, by_name = self.times_for(row.get("name", "") or default_name, seed)
        return {**row, **times}, by_name


def finite_number(text: str) -> float | None:
    """A column's value as a finite float, None when it is empty, not a number, or infinite."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def load_time_source(path: str) -> TimeSource:
    """Read an Alibaba pod list with times. Raises TimeSourceError (bad file) or OSError."""
    errors: list[str] = []

    def bad(line: int, field: str, message: str) -> None:
        errors.append(f"{path}: line {line}, field {field!r}: {message}")

    by_name: dict[str, dict[str, str]] = {}
    pool: list[dict[str, str]] = []
    last_deletion = -math.inf
    with csv_lines(path) as lines:
        reader = csv.DictReader(lines)
        header = [c.strip() for c in reader.fieldnames or []]
        missing = [c for c in ("name", "num_gpu", *TIME_COLUMNS) if c not in header]
        if missing:
            raise TimeSourceError(f"{path}: --times-from needs an Alibaba pod list with times; its header lacks "
                                  f"{', '.join(missing)}")
        reader.fieldnames = header
        for row in reader:
            line = reader.line_num
            get = {k: (row.get(k) or "").strip() for k in ("name", "num_gpu", *TIME_COLUMNS)}
            values: dict[str, float | None] = {}
            for col in TIME_COLUMNS:
                text = get[col]
                if text == "":
                    if col != "scheduled_time":  # only a never-scheduled pod may lack a time
                        bad(line, col, "missing value")
                    values[col] = None
                    continue
                values[col] = finite_number(text)
                if values[col] is None:
                    bad(line, col, f"{text!r} is not a number")
            times = {c: get[c] for c in TIME_COLUMNS}
            if get["name"]:
                by_name.setdefault(get["name"], times)
            gpus = finite_number(get["num_gpu"])
            sched, deleted = values["scheduled_time"], values["deletion_time"]
            if deleted is not None:
                last_deletion = max(last_deletion, deleted)
            if gpus is not None and gpus >= 1 and sched is not None and deleted is not None and deleted > sched:
                pool.append(times)
            if len(errors) >= MAX_ERRORS:
                break
    if errors:
        raise TimeSourceError("\n".join(errors))
    if not pool:
        raise TimeSourceError(f"{path}: no replayable pod (a GPU pod with scheduled_time and a positive "
                              "duration) to draw times from")
    return TimeSource(path, by_name, tuple(pool), last_deletion)
