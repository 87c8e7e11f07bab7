"""Shared helpers for replay tests: write a small CSV trace into a temp dir."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

# A small pod list written for these tests in the column format of alibaba/clusterdata
# `cluster-trace-gpu-v2023` (`openb_pod_list_*.csv`); no rows of the real trace (see tests/fixtures/README.md).
ALIBABA = Path(__file__).resolve().parents[1] / "fixtures" / "alibaba-openb-sample.csv"


@pytest.fixture
def write_csv(tmp_path: Path) -> Callable[[str], str]:
    def write(text: str) -> str:
        path = tmp_path / "trace.csv"
        path.write_text(text.lstrip())
        return str(path)

    return write
