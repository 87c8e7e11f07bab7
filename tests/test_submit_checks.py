"""A submit's measures and checks, kept equal to their plain definitions where the daemon takes a
shorter way to them (model.spec_bytes, submittable.check_submittable, protocol_results.ok_body)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpusched.model import SPEC_STRING_OVERHEAD, JobSpec, JobState, WholeRequest, spec_bytes, utf8_len
from gpusched.protocol import HEADER, SubmitResult, encode_frame, ok, ok_body
from gpusched.submittable import MAX_ARG_STRLEN, check_submittable

_any_text = st.text(max_size=6)  # lone surrogates and astral characters included
_spec_fields = st.fixed_dictionaries({
    "argv": st.lists(_any_text, min_size=1, max_size=4),
    "cwd": _any_text.map(lambda t: "/" + t),
    "env": st.dictionaries(_any_text, _any_text, max_size=4),
    "name": st.none() | _any_text,
})


@given(fields=_spec_fields)
def test_spec_bytes_is_each_strings_utf8_bytes_and_its_overhead(fields: dict[str, object]) -> None:
    """Counted in one join (a variable's name and value apart, ASCII without an encode), the sum
    over the strings the spec holds, a variable being `NAME=value`."""
    spec = JobSpec.model_construct(**fields, request=WholeRequest(gpus=1))
    strings = [*spec.argv, spec.cwd, *(f"{k}={v}" for k, v in spec.env.items())]
    strings += [] if spec.name is None else [spec.name]
    assert spec_bytes(spec) == sum(utf8_len(s) + SPEC_STRING_OVERHEAD for s in strings)


def _spec(argv: list[str], env: dict[str, str] | None = None) -> JobSpec:
    return JobSpec(argv=argv, cwd="/tmp", env=env or {}, request=WholeRequest(gpus=1))


@pytest.mark.parametrize("where", ["argv", "env"])
def test_a_string_execve_refuses_is_refused_at_its_first_byte_too_many(where: str) -> None:
    """Strings are measured one by one only in a spec over MAX_ARG_STRLEN: the longest one execve
    takes passes, one byte more is refused (a spec just over the limit is measured)."""
    for nbytes, refused in ((MAX_ARG_STRLEN - 1, False), (MAX_ARG_STRLEN, True)):  # the string's, without its NUL
        if where == "argv":
            spec = _spec(["true", "\u00e9" + "x" * (nbytes - 2)])  # (bytes are counted, not characters)
        else:
            spec = _spec(["true"], {"X": "x" * (nbytes - 2)})  # `X=` and its value
        if refused:
            with pytest.raises(ValueError, match=f"takes {MAX_ARG_STRLEN + 1} bytes with its NUL"):
                check_submittable(spec)
        else:
            check_submittable(spec)


def test_the_submit_answer_written_by_hand_knows_every_field() -> None:
    """ok_body writes a SubmitResult itself: a field added to it must be added there too."""
    assert list(SubmitResult.model_fields) == ["job_id", "state", "tasks", "duplicate"]


@given(job_id=st.integers(1, 2**63 - 1), state=st.sampled_from(JobState), tasks=st.none() | st.integers(0, 10**6),
       duplicate=st.booleans())
def test_a_submit_answer_is_the_bytes_of_the_general_path(job_id: int, state: JobState, tasks: int | None,
                                                          duplicate: bool) -> None:
    result = SubmitResult(job_id=job_id, state=state, tasks=tasks, duplicate=duplicate)
    assert ok_body(result) == encode_frame(ok(result))[HEADER.size :]
