"""Sizes and time limits as users type them; the formats the CLI prints must read back the same."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpusched_cli.parse import parse_dependencies, parse_duration_s, parse_size_mib
from gpusched_cli.render import format_duration, format_mib


@pytest.mark.parametrize(
    ("text", "mib"),
    [
        ("1024", 1024),
        ("512M", 512),
        ("512MiB", 512),
        ("512mb", 512),
        ("10G", 10 * 1024),
        ("10g", 10 * 1024),
        ("10GB", 10 * 1024),
        ("1.5GiB", 1536),
        (" 2 GiB ", 2048),
        ("1T", 1024 * 1024),
        ("2048K", 2),
        ("100K", 1),  # rounded up: a cap is never below what was asked
        (".0000000001", 1),  # however little above zero: 1 MiB, not 0
        (".0000000001K", 1),
        (".5G", 512),
    ],
)
def test_sizes(text: str, mib: int) -> None:
    assert parse_size_mib(text) == mib


@pytest.mark.parametrize("text", ["", "G", "abc", "10X", "10B", "-1G", "0", "0G", "1e3M", "1,5G", "10 G B"])
def test_bad_sizes_say_what_is_accepted(text: str) -> None:
    with pytest.raises(ValueError, match=r"not a size|larger than zero"):
        parse_size_mib(text)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 90 * 60),  # Slurm: a bare number is minutes
        ("10:00", 600),
        ("1:30", 90),
        ("1:00:00", 3600),
        ("2-00:00:00", 2 * 86400),
        ("1-12", 36 * 3600),
        ("1-0:30", 86400 + 1800),
        ("30s", 30),
        ("5m", 300),
        ("2h", 7200),
        ("1d", 86400),
        ("1h30m", 5400),
        ("1d2h3m4s", 93784),
        ("5M", 300),
        # Slurm does not range-check the fields (src/common/parse_time.c): scripts written for
        # sbatch that say 0:90:00 mean 90 minutes, and get them here too
        ("10:99", 10 * 60 + 99),
        ("0:90:00", 90 * 60),
        ("1-30", 86400 + 30 * 3600),
    ],
)
def test_durations(text: str, seconds: int) -> None:
    assert parse_duration_s(text) == seconds


@pytest.mark.parametrize("text", ["", "abc", "0", "0s", "1:2:3:4", "-5", "5x", "1h-3", "1-", ":30", "1.5h"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError, match=r"not a time limit|longer than zero"):
        parse_duration_s(text)


@given(st.integers(min_value=1, max_value=10**9))
def test_printed_durations_read_back(seconds: int) -> None:
    assert parse_duration_s(format_duration(seconds)) == seconds


@given(st.integers(min_value=1, max_value=10**8))
def test_mib_and_gib_read_back_exactly(n: int) -> None:
    assert parse_size_mib(f"{n}") == n
    assert parse_size_mib(f"{n}M") == n
    assert parse_size_mib(f"{n}G") == n * 1024


@given(st.integers(min_value=1, max_value=10**9))
def test_printed_sizes_read_back_within_rounding(mib: int) -> None:
    # format_mib keeps one decimal in the largest unit, so at most 5% (plus the round-up) is lost.
    parsed = parse_size_mib(format_mib(mib))
    assert abs(parsed - mib) <= 0.05 * mib + 1


@pytest.mark.parametrize(
    ("text", "deps"),
    [("12", [(12, None, "ok")]), ("12:any", [(12, None, "any")]), ("12:OK", [(12, None, "ok")]),
     ("12, 13:any", [(12, None, "ok"), (13, None, "any")]), ("120_7", [(120, 7, "ok")]),
     ("120_0:any,5", [(120, 0, "any"), (5, None, "ok")])],
)
def test_dependencies(text: str, deps: list[tuple[int, int | None, str]]) -> None:
    assert parse_dependencies(text) == deps


@pytest.mark.parametrize("text", ["", "x", "0", "12:maybe", "12,", "-1", "12:ok:any", "120_", "_7", "120_7_1"])
def test_bad_dependencies(text: str) -> None:
    with pytest.raises(ValueError, match="not a dependency"):
        parse_dependencies(text)


def test_export_follows_sbatch() -> None:
    from gpusched_cli.parse import parse_export

    env = {"HOME": "/home/a", "PATH": "/bin", "TOKEN": "s3cret"}
    assert parse_export("ALL", env) == env
    assert parse_export("NONE", env) == {}
    assert parse_export("PATH,MISSING,MODE=fast", env) == {"PATH": "/bin", "MODE": "fast"}
    assert parse_export("ALL,MODE=fast", env) == {**env, "MODE": "fast"}
    assert parse_export("NONE,PATH", env) == {"PATH": "/bin"}
    for bad in ("", "1BAD", "A-B=1"):
        with pytest.raises(ValueError):
            parse_export(bad, env)
