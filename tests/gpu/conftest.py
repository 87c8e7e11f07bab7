"""Fixtures for the GPU layer: simulators per model and a helper to read NVML errors by code."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gpusched.gpu.profiles import MODEL_KEYS
from gpusched.gpu.simnvml import SimNVML


@pytest.fixture(params=MODEL_KEYS)
def model(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def sim(model: str) -> Iterator[SimNVML]:
    """One initialised simulated GPU of the parametrised model, MIG off."""
    s = SimNVML([model], seed=1234)
    s.nvmlInit()
    yield s


@pytest.fixture
def mig_sim(sim: SimNVML) -> SimNVML:
    """The same, with MIG enabled."""
    assert sim.nvmlDeviceSetMigMode(sim.nvmlDeviceGetHandleByIndex(0), 1) == 0
    return sim
