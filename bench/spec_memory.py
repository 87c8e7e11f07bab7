"""Daemon memory held per pending job, for specs shaped to be as expensive as the byte cap allows.

The daemon keeps every unfinished job in memory (engine.jobs), parsed from the database as the
engine loads it. A spec's wire size is capped (model.MAX_SPEC_BYTES); this measures what such a
spec costs once it is Python objects, for shapes chosen to maximise that cost, so docs/security.md
can state the worst case per user (x max_pending_per_user). Prints one line per shape.

    .venv/bin/python bench/spec_memory.py [--quick]
"""

from __future__ import annotations

import argparse
import gc
import tracemalloc
from collections.abc import Callable

from gpusched.model import MAX_SPEC_BYTES, SPEC_STRING_OVERHEAD, Job, JobSpec, JobState, WholeRequest, spec_bytes

FILL = MAX_SPEC_BYTES - 200  # room for argv ["true"], cwd and the overhead of those strings


def _ascii_value() -> JobSpec:
    return _spec(env={"V": "x" * (FILL - 2)})


def _wide_value() -> JobSpec:
    """One astral character makes CPython store the whole string 4 bytes per character (PEP 393)."""
    return _spec(env={"V": "\U0001F600" + "x" * (FILL - 6)})


def _many_env_entries() -> JobSpec:
    per = SPEC_STRING_OVERHEAD + 7  # "k%05d=" is 7 bytes
    return _spec(env={f"k{i:05d}": "" for i in range(FILL // per)})


def _many_arguments() -> JobSpec:
    per = SPEC_STRING_OVERHEAD + 3  # distinct three-character strings are separate objects
    return _spec(argv=["true", *(_word(i) for i in range(FILL // per))])


def _word(i: int) -> str:
    return "".join(chr(33 + (i // 94**k) % 94) for k in range(3))


def _spec(argv: list[str] | None = None, env: dict[str, str] | None = None) -> JobSpec:
    return JobSpec(argv=argv or ["true"], cwd="/tmp", env=env or {}, request=WholeRequest(gpus=1))


SHAPES: dict[str, Callable[[], JobSpec]] = {
    "one ASCII value": _ascii_value,
    "one value with an astral character": _wide_value,
    "many small environment entries": _many_env_entries,
    "many short distinct arguments": _many_arguments,
}


def held_bytes(spec: JobSpec, copies: int) -> float:
    """Bytes of Python heap per job for `copies` jobs loaded from JSON, as the engine loads them."""
    text = spec.model_dump_json()
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    jobs = [Job(id=i + 1, uid=1000, gid=1000, user="u", spec=JobSpec.model_validate_json(text),
                state=JobState.PENDING, submitted_at=0.0) for i in range(copies)]
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del jobs
    return (after - before) / copies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one copy of each shape (smoke run)")
    args = parser.parse_args()
    copies = 1 if args.quick else 8
    print(f"spec cap {MAX_SPEC_BYTES} bytes; heap per held job, mean of {copies} copies")
    worst = 0.0
    for name, make in SHAPES.items():
        spec = make()
        per_job = held_bytes(spec, copies)
        worst = max(worst, per_job)
        print(f"  {name:<38} {spec_bytes(spec):>7} counted bytes  {per_job / 1024:8.0f} KiB held "
              f"({per_job / spec_bytes(spec):.1f}x)")
    print(f"worst case per held job: {worst / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
