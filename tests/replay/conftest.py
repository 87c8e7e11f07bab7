"""Shared helpers for replay tests: write a small CSV trace into a temp dir."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

ALIBABA = Path(__file__).resolve().parents[3] / "shared" / "traces" / "alibaba-gpu-v2023-openb_pod_list_default.csv"


@pytest.fixture
def write_csv(tmp_path: Path) -> Callable[[str], str]:
    def write(text: str) -> str:
        path = tmp_path / "trace.csv"
        path.write_text(text.lstrip())
        return str(path)

    return write
