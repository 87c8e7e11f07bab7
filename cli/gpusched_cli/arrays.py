"""How the client writes job arrays and their tasks for people.

A task is `ARRAY_TASK` (`120_7`: task 7 of array 120), the form `show`, `logs` and `cancel` read
back (common.REF), and an array is `120_[1-10000%8]`, as squeue writes them. Kept apart from
render.py (tables and pages) so that each stays one job; like it, this reads plain JSON results and
imports no pydantic (gpusched.arrayspec is standard library only): `queue`, `show` and `cancel` load it.
"""

from __future__ import annotations

from gpusched.arrayspec import compress

TYPE_CHECKING = False  # typing costs the fast path a few ms to import; mypy reads this as True
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from gpusched_cli.results import JSON

# `array_states` lists active states first, then waiting ones, then the rest (finished) by name.
_STATE_ORDER = {state: i for i, state in enumerate(("STARTING", "RUNNING", "SUSPENDED", "PREEMPTED", "PENDING",
                                                    "HELD"))}
# More ids than this are written as runs (`121-10120`): a cancelled 10,000-task array is one line, not 60 KB.
IDS_AS_RUNS = 50


def job_ref(job: JSON) -> str:
    """`123`, or `120_7` for task 7 of array 120: the form `show`, `logs` and `cancel` take back."""
    array_id = job.get("array_id")
    return f"{array_id}_{job['array_task']}" if array_id is not None else str(job["id"])


def array_ref(array: JSON) -> str:
    """`123_[1-10000%8]`, as squeue writes an array: its id and its --array spec."""
    return f"{array['id']}_[{array['spec']}]"


def array_states(array: JSON) -> str:
    """`RUNNING:8,PENDING:9990,COMPLETED:2`: active states first, then waiting, then finished."""
    counts: Mapping[str, int] = array["states"]
    states = sorted(counts.items(), key=lambda kv: (_STATE_ORDER.get(kv[0], len(_STATE_ORDER)), kv[0]))
    return ",".join(f"{state}:{count}" for state, count in states)


def array_line(job: JSON, array: JSON) -> str:
    """`show`'s `array` field: `task 2 of array 1_[0-3%2]: 4 tasks, at most 2 at once; CANCELLED:4`."""
    cap = f", at most {array['max_running']} at once" if array.get("max_running") else ""
    return (f"task {job.get('array_task')} of array {array_ref(array)}: {array['tasks']} tasks{cap}; "
            f"{array_states(array)}")


def ids_text(ids: Sequence[int]) -> str:
    """`3, 5`; past IDS_AS_RUNS ids, runs of them (`124-10123, 10200`)."""
    if len(ids) > IDS_AS_RUNS:
        return compress(sorted(ids)).replace(",", ", ")
    return ", ".join(str(i) for i in ids)

