"""Importing bench/ scripts in tests: they import their neighbours (harness) as top-level modules."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCH = str(Path(__file__).resolve().parents[2] / "bench")


@pytest.fixture
def bench_module() -> Iterator[Callable[[str], ModuleType]]:
    """`bench_module("harness")`: that bench/ module, with bench/ on sys.path for the test's length."""
    sys.path.insert(0, BENCH)
    try:
        yield importlib.import_module
    finally:
        sys.path.remove(BENCH)
