"""`--array` specs as sbatch writes them, and `ARRAY_TASK` job references (`123_7`).

Pure and dependency-free, so the client checks a spec before it connects and the daemon checks it
again with the same rules (the daemon's check is the one that counts: it also applies
`max_array_size`). Grammar, as sbatch's `--array`:

    SPEC  := PART ("," PART)* ["%" MAX]
    PART  := INDEX | INDEX "-" INDEX [":" STEP]

Indices are non-negative integers; a range includes both ends; duplicates are dropped and the
tasks are kept in ascending order. `%MAX` caps how many of the array's tasks run at once.
"""

from __future__ import annotations

import re

# No index beyond this: task ids go into environment variables and a C `int` (as Slurm's do).
MAX_TASK_INDEX = 2**31 - 1
# The most tasks any spec may expand to, whatever the daemon allows (it caps them lower with
# max_array_size); counted before expanding, so `0-2000000000` costs nothing to refuse.
HARD_MAX_TASKS = 1_000_000
MAX_SPEC_CHARS = 65_536

# Kept as text and matched through re's cache: compiled on first use, not at every start of the client.
_PART = r"^([0-9]+)(?:-([0-9]+)(?::([0-9]+))?)?$"
_REF = r"^([0-9]+)(?:_([0-9]+))?$"


class ArraySpecError(ValueError):
    """The spec is not valid; the message says what is wrong (callers name the flag or field)."""


class ArraySpec:
    """The expanded spec: its task indices (ascending, unique) and the %MAX, if any.

    A plain class, not a dataclass: dataclasses imports inspect, and `gpusched submit --array`
    starts on the client's fast path (issue 13). Immutable in use; compared by value."""

    __slots__ = ("max_running", "tasks", "text")

    def __init__(self, tasks: tuple[int, ...], max_running: int | None, text: str) -> None:
        self.tasks = tasks
        self.max_running = max_running
        self.text = text  # as given, whitespace removed: what `show` and `queue` print

    @property
    def count(self) -> int:
        return len(self.tasks)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ArraySpec) and (self.tasks, self.max_running, self.text) == (
            other.tasks, other.max_running, other.text)

    def __hash__(self) -> int:
        return hash((self.tasks, self.max_running, self.text))

    def __repr__(self) -> str:
        return f"ArraySpec(tasks={self.tasks!r}, max_running={self.max_running!r}, text={self.text!r})"


def parse_array_spec(text: str, max_tasks: int = HARD_MAX_TASKS) -> ArraySpec:
    """Parse `A-B[:STEP][,...][%MAX]`; raises ArraySpecError naming the offending part."""
    spec = "".join(text.split())
    if not spec:
        raise ArraySpecError("is empty; give task indices such as 1-100, 0-30:10 or 1,3,5-7 (optionally %MAX)")
    if len(spec) > MAX_SPEC_CHARS:
        raise ArraySpecError(f"is {len(spec)} characters long; at most {MAX_SPEC_CHARS} are accepted")
    body, percent, limit = spec.partition("%")
    max_running: int | None = None
    if percent:
        if not limit.isdigit() or not limit.isascii():
            raise ArraySpecError(f"%{limit}: the part after % must be a whole number of tasks to run at once")
        max_running = int(limit)
        if max_running < 1:
            raise ArraySpecError("%0: at least one task must be allowed to run at once")
    if not body:
        raise ArraySpecError(f"%{limit} limits tasks, but no task indices come before it; write e.g. 1-100%{limit}")
    ranges: list[range] = []
    total = 0
    for part in body.split(","):
        if not part:
            raise ArraySpecError("has an empty part (two commas in a row, or a comma at an end)")
        found = re.match(_PART, part) if part.isascii() else None
        if found is None:
            raise ArraySpecError(f"{part!r} is not an index or a range; write N, A-B or A-B:STEP "
                                 "(e.g. 1-100:2)")
        first = int(found.group(1))
        last = int(found.group(2)) if found.group(2) is not None else first
        step = int(found.group(3)) if found.group(3) is not None else 1
        if last > MAX_TASK_INDEX:
            raise ArraySpecError(f"{part!r}: task index {last} is above the largest allowed, {MAX_TASK_INDEX}")
        if last < first:
            raise ArraySpecError(f"{part!r}: the range ends before it starts ({last} < {first})")
        if step < 1:
            raise ArraySpecError(f"{part!r}: the step must be at least 1")
        span = range(first, last + 1, step)
        total += len(span)
        if total > max_tasks:
            raise ArraySpecError(f"has more than {max_tasks} tasks; at most {max_tasks} are allowed per array")
        ranges.append(span)
    tasks = tuple(ranges[0]) if len(ranges) == 1 else tuple(sorted({i for span in ranges for i in span}))
    return ArraySpec(tasks=tasks, max_running=max_running, text=spec)


def parse_job_ref(text: str) -> tuple[int, int | None]:
    """`123` -> (123, None); `123_7` -> (123, 7): job (or array) 123, task 7 of array 123."""
    found = re.match(_REF, text.strip()) if text.isascii() else None
    if found is None:
        raise ArraySpecError(f"{text!r} is not a job id; write ID (e.g. 123) or ARRAY_TASK (e.g. 123_7)")
    job_id = int(found.group(1))
    if not 1 <= job_id <= 2**63 - 1:
        raise ArraySpecError(f"{text!r}: job ids are from 1 to {2**63 - 1}")
    task = int(found.group(2)) if found.group(2) is not None else None
    if task is not None and task > MAX_TASK_INDEX:
        raise ArraySpecError(f"{text!r}: task index {task} is above the largest allowed, {MAX_TASK_INDEX}")
    return job_id, task


def compress(tasks: list[int] | tuple[int, ...]) -> str:
    """Ascending task indices as sbatch writes them: `1-3,7,9-10` (runs of consecutive indices)."""
    parts: list[str] = []
    start = prev = None
    for i in tasks:
        if prev is not None and i == prev + 1:
            prev = i
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = i
    if start is not None:
        parts.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(parts)
