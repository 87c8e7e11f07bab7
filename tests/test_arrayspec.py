"""The `--array` grammar (sbatch's): examples, every error named, and properties over random specs."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpusched.arrayspec import (
    MAX_TASK_INDEX,
    ArraySpecError,
    compress,
    parse_array_spec,
    parse_job_ref,
)


@pytest.mark.parametrize(("text", "tasks", "limit"), [
    ("1-5", (1, 2, 3, 4, 5), None),
    ("0-15:4", (0, 4, 8, 12), None),
    ("1,3,5-7", (1, 3, 5, 6, 7), None),
    ("7", (7,), None),
    ("1-10000%8", tuple(range(1, 10001)), 8),
    ("5-7,1-3:2,6", (1, 3, 5, 6, 7), None),
    (" 1 - 3 % 2 ", (1, 2, 3), 2),
])
def test_examples(text: str, tasks: tuple[int, ...], limit: int | None) -> None:
    spec = parse_array_spec(text)
    assert (spec.tasks, spec.max_running, spec.count) == (tasks, limit, len(tasks))


@pytest.mark.parametrize(("text", "needle"), [
    ("", "is empty"),
    ("5-1", "ends before it starts"),
    ("1-10:0", "step must be at least 1"),
    ("1--2", "is not an index or a range"),
    ("-1", "is not an index or a range"),
    ("1,,2", "has an empty part"),
    ("1,%2", "has an empty part"),
    ("%3", "no task indices come before it"),
    ("a-b", "is not an index or a range"),
    ("1-4%0", "at least one task"),
    ("1-4%x", "whole number"),
    ("1-4%2%3", "whole number"),
    ("\u0661-\u0663", "is not an index"),  # Arabic-Indic digits are digits to Python, not to sbatch
    (f"0-{MAX_TASK_INDEX + 1}", "above the largest allowed"),
])
def test_errors_say_what_is_wrong(text: str, needle: str) -> None:
    with pytest.raises(ArraySpecError, match=needle):
        parse_array_spec(text)


def test_size_is_checked_before_expanding() -> None:
    with pytest.raises(ArraySpecError, match="at most 10001"):
        parse_array_spec(f"0-{MAX_TASK_INDEX}", max_tasks=10001)  # refused at once, nothing expanded
    with pytest.raises(ArraySpecError, match="at most 3"):
        parse_array_spec("1-2,5-6", max_tasks=3)


def test_job_refs() -> None:
    assert parse_job_ref("123") == (123, None)
    assert parse_job_ref("123_7") == (123, 7)
    for bad in ("0", "12_", "_7", "1_2_3", "x", "-5", f"1_{MAX_TASK_INDEX + 1}"):
        with pytest.raises(ArraySpecError):
            parse_job_ref(bad)


PARTS = st.tuples(st.integers(0, 300), st.integers(0, 300), st.integers(1, 40))


@given(st.lists(PARTS, min_size=1, max_size=6), st.one_of(st.none(), st.integers(1, 50)), st.booleans())
def test_a_spec_means_the_union_of_its_ranges(parts: list[tuple[int, int, int]], limit: int | None,
                                              steps: bool) -> None:
    written, expected = [], set()
    for a, length, step in parts:
        b = a + length
        if length == 0:
            written.append(str(a))
        elif steps:
            written.append(f"{a}-{b}:{step}")
        else:
            written.append(f"{a}-{b}")
            step = 1
        expected.update(range(a, b + 1, step) if length else {a})
    text = ",".join(written) + (f"%{limit}" if limit is not None else "")
    spec = parse_array_spec(text)
    assert spec.tasks == tuple(sorted(expected))
    assert spec.max_running == limit
    assert parse_array_spec(compress(spec.tasks)).tasks == spec.tasks  # `queue` prints what parses back


@given(st.text(alphabet="0123456789-:,% x", max_size=30))
def test_any_text_parses_or_is_refused_with_a_reason(text: str) -> None:
    try:
        spec = parse_array_spec(text, max_tasks=5000)
    except ArraySpecError as exc:
        assert str(exc)
    else:
        assert spec.tasks and list(spec.tasks) == sorted(set(spec.tasks)) and len(spec.tasks) <= 5000


@given(st.lists(st.integers(0, 1000), min_size=1, max_size=50))
def test_compress_writes_runs(indices: list[int]) -> None:
    tasks = tuple(sorted(set(indices)))
    text = compress(tasks)
    assert parse_array_spec(text).tasks == tasks
    assert all(part for part in text.split(","))
